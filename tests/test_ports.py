"""runtime/ports.py: ports handed to children are outside the kernel's ephemeral range (where a bind(0) or an
outgoing connection elsewhere could take them before the child binds), free, and never handed out twice."""

from __future__ import annotations

import socket

from rlserve.runtime import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    low = ports.ephemeral_low()
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(low - ports.POOL_SIZE <= p < low for p in picked)
    for p in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch):
    low = ports.ephemeral_low()
    monkeypatch.setattr(ports, "POOL_SIZE", 2)  # the pool: low - 2 and low - 1
    monkeypatch.setattr(ports, "_handed", set())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", low - 1))
        taken.listen()
        assert ports.free_port() == low - 2
        # the pool spent (one taken, one handed out): the kernel's choice, still never a port handed out before
        assert ports.free_port() not in (low - 1, low - 2)
