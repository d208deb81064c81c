"""rlserve: an inference server for reinforcement-learning rollouts."""

__version__ = "0.1.0"
