"""``import mempool.auto``: mempool's default pools as PyTorch's and CuPy's allocator.

The import does what ``python -m mempool run`` does before it runs a script
(:func:`mempool.run.install_default`), for ``python -c``, a notebook's first cell, or a
script that may carry one import line; it must come before the first CUDA tensor. One line on
stderr says what was hooked; ``mempool.auto.installed`` holds the details. A child process
that installed from its parent, and multiprocessing's forkserver process (which imports a
script's top-level imports again), say nothing unless ``MEMPOOL_CHILDREN=verbose``
(mempool/_children.py).
"""
import sys as _sys

from mempool import _children
from mempool.run import Installed as _Installed
from mempool.run import install_default as _install_default

installed: _Installed = _install_default()
if not _children.quiet():
    print(f"mempool: {installed.describe()}", file=_sys.stderr, flush=True)
