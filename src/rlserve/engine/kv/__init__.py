"""The KV cache tiers: the block pool, the CPU offload tier, the block format on the wire, and prefill/decode transfer."""
