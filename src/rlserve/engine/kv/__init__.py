"""The KV cache tiers: the block pool, the CPU/disk offload tier, the block format on disk and on the wire, and
prefill/decode transfer."""
