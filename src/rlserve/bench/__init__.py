"""`rlserve bench`: throughput and latency of the offline engine (`throughput`) or of a running
server or deployment over HTTP (`serve`), as a table, JSON and a PNG plot."""
