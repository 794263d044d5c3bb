"""The allocation latency suite, run by ``python -m mempool bench`` (see bench/README.md of
the source tree). A package inside mempool so that an installed wheel carries it; its tests
run under pytest-benchmark (the ``bench`` extra)."""
