"""The GPU tier: tests that need a CUDA device (each module skips itself without one)."""
