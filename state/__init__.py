"""The bottom layer: cross-worker state in shared memory (the tables every worker reads and writes)."""
