"""``import mempool.auto``: mempool's default pools as PyTorch's and CuPy's allocator.

The import does what ``python -m mempool run`` does before it runs a script
(:func:`mempool.run.install_default`), for ``python -c``, a notebook's first cell, or a
script that may carry one import line; it must come before the first CUDA tensor. One line on
stderr says what was hooked; ``mempool.auto.installed`` holds the details.
"""
import sys as _sys

from mempool.run import Installed as _Installed
from mempool.run import install_default as _install_default

installed: _Installed = _install_default()
print(f"mempool: {installed.describe()}", file=_sys.stderr, flush=True)
