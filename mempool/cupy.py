"""CuPy on a mempool pool: the allocator hook and arrays on pool memory.

``set_allocator(pool)`` makes every CuPy allocation come from the pool
(``cupy.cuda.set_allocator(pool.malloc)``); ``use(pool)`` does it for a ``with`` block and
restores the previous allocator after. CuPy allocates on its current stream; blocks freed by
CuPy go back to the pool in stream order. This module imports cupy only when a function is
called.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mempool._errors import require_instance, require_open

if TYPE_CHECKING:
    from mempool._core import Pool


def _cupy():
    try:
        import cupy
    except ImportError:
        raise ImportError("mempool.cupy needs CuPy (pip install cupy-cuda12x or "
                          "cupy-cuda13x)") from None
    return cupy


def _check_pool(pool: object) -> None:
    from mempool import _core
    require_instance(pool, _core.Pool, "pool")
    require_open(pool, "pool")


def set_allocator(pool: Pool | None) -> None:
    """Route CuPy's allocations to `pool` (None: back to CuPy's default memory pool)."""
    if pool is not None:
        _check_pool(pool)
    cupy = _cupy()
    if pool is None:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    else:
        cupy.cuda.set_allocator(pool.malloc)


@contextlib.contextmanager
def use(pool: Pool) -> Iterator[Pool]:
    """``with use(pool):`` CuPy allocates from `pool` (process-wide, as
    ``cupy.cuda.set_allocator``); the previous allocator is restored on exit. For a
    per-thread switch use ``cupy.cuda.using_allocator(pool.malloc)``."""
    _check_pool(pool)
    cupy = _cupy()
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        yield pool
    finally:
        cupy.cuda.set_allocator(previous)


def from_pool(pool: Pool, shape: int | tuple[int, ...], dtype: Any = "float32") -> Any:
    """A new, uninitialised ``cupy.ndarray`` on `pool`'s memory (on CuPy's current
    stream), whatever CuPy's allocator is."""
    _check_pool(pool)
    from mempool import _core
    shape = _core._dl_shape(shape)                 # the checks and messages of Pool.empty
    import numpy
    dt = numpy.dtype(dtype)
    cupy = _cupy()
    nbytes = dt.itemsize
    for d in shape:
        nbytes *= d
    return cupy.ndarray(shape, dt, memptr=pool.malloc(nbytes))
