"""Deployments: several `rlserve serve` replicas behind vllm-router, one admin address for all of them,
supervision (restart, resync to the current weights), and multi-node placement on Ray."""
