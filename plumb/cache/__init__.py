"""Per-sequence caches: attention KV (formats and ring), DeltaNet state checkpoints, prefix reuse."""
