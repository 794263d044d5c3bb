# The DLPack bridge: mempool.Buffer (see docs/architecture.md).
