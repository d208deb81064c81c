"""The RL routes trainers call: native generate, control (pause, weights, adapters), weight pulls, uploads."""
