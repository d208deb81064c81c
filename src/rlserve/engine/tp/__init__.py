"""Tensor parallelism: the rank-0 leader inside the engine, the worker processes, and the messages between them."""
