"""Offline tools: what works on traces and snapshots, away from the allocation path.

``trace`` (record, save, load, import PyTorch's and RMM's), ``replay`` (a trace on a pool),
``tune`` (the settings that use least memory for a trace), ``report`` (PyTorch's summary and
snapshot formats) and ``plot`` (segment maps, memory over time). The command line's
``replay``, ``tune`` and ``plot`` (mempool/cli) are thin faces of these.
"""
