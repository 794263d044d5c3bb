"""JAX on mempool memory: zero-copy hand-off, and how to make JAX share the device's pool.

Hand-off
--------
``from_buffer(buf)`` (or ``jax.dlpack.from_dlpack(buf)`` / ``jnp.from_dlpack(buf)``) gives
JAX a :class:`mempool.Buffer` without a copy. JAX passes its stream, so its work is ordered
after the Buffer's stream (an event wait, no host sync) and the pool does not reuse the block
before JAX's work on it is done. The array owns the block: deleting it returns the memory
to the pool. XLA views only aligned memory in place: given a data pointer that is not a
multiple of :data:`JAX_ALIGNMENT` bytes (only an offset ``view()`` makes one) JAX silently
copies it (jaxlib logs "DLPack buffer is not aligned ... Creating a copy"), so the array is no
longer on the pool. :func:`from_buffer` refuses such a Buffer with a clear error instead,
unless ``allow_copy=True``.

Sharing memory with JAX's own allocations
-----------------------------------------
JAX (XLA) keeps its own pool and by default preallocates 75% of the GPU at the first JAX
operation, leaving little for CuPy, PyTorch or mempool. Two environment variables, set
before JAX initialises its GPU backend (``configure()`` sets them), change that:

``XLA_PYTHON_CLIENT_PREALLOCATE=false``
    No preallocation; JAX allocates as it goes.
``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``
    JAX allocates with ``cuMemAllocFromPoolAsync`` from the **device's default
    cudaMemPool** (XLA's ``GpuCudaMallocAsyncAllocator``). jaxlib accepts ``default``
    (BFC), ``bfc``, ``platform`` (plain cudaMalloc/cudaFree, slow) and ``cuda_async``.

With both set, a ``mempool.Pool(backend="cuda", pool_handle="default")`` draws its segments
from the same cudaMemPool as JAX: memory JAX frees can serve mempool's next segment and the
other way round, and the driver's accounting covers both. Note that XLA sets the default
pool's release threshold to its memory fraction (``XLA_CLIENT_MEM_FRACTION``, default 0.75
of the device) when it starts; the last of XLA and mempool to set it wins, so create the Pool
after JAX's first GPU operation if mempool's ``release_threshold`` should apply. Memory the
cudaMemPool caches is then shared by both; mempool's own free lists stay mempool's.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mempool._core import Buffer, Pool

#: Bytes of alignment XLA needs to view imported memory in place (below it jaxlib copies).
#: Pool blocks are 512-byte aligned, so only an offset view can miss it.
JAX_ALIGNMENT = 64

#: The environment that makes JAX allocate on demand from the device's default cudaMemPool.
SHARING_ENV = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async",
}


def configure(overwrite: bool = False) -> dict[str, str]:
    """Set :data:`SHARING_ENV` in ``os.environ`` (keeping values already set unless
    `overwrite`). Call before JAX's first GPU operation; returns the values in force.

    Raises
    ------
    RuntimeError
        JAX's GPU backend is already initialised, so the settings could no longer apply.
    """
    import sys
    if "jax" in sys.modules and _backend_initialised(sys.modules["jax"]):
        raise RuntimeError("configure: JAX has already initialised its backends; set "
                           "XLA_PYTHON_CLIENT_PREALLOCATE / XLA_PYTHON_CLIENT_ALLOCATOR "
                           "before the first JAX operation (or in the environment)")
    for key, value in SHARING_ENV.items():
        if overwrite:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in SHARING_ENV}


def _backend_initialised(jax):
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    return bool(getattr(xla_bridge, "_backends", None))


def shared_pool(device: int = 0, **options: Any) -> Pool:
    """A ``Pool(backend="cuda", pool_handle="default")`` on `device`: segments from the
    device's default cudaMemPool, the one JAX uses under ``cuda_async``."""
    from mempool import Pool
    return Pool(backend="cuda", device=device, pool_handle="default", **options)


def check_importable(buf: Buffer, allow_copy: bool = False) -> None:
    """Raise ValueError if JAX cannot view `buf` in place: a simulated pool's memory, or
    (unless `allow_copy`) data that is not :data:`JAX_ALIGNMENT`-byte aligned, which JAX
    would copy."""
    from mempool import _core
    from mempool._errors import require_instance
    require_instance(buf, _core.Buffer, "buf")
    if buf.backend == "sim":
        raise ValueError("buf: a sim pool's memory is simulated and cannot be handed to JAX; "
                         "use a host pool (CPU) or a cuda pool (GPU)")
    if buf.ptr % JAX_ALIGNMENT and not allow_copy:
        raise ValueError(f"buf: JAX views memory in place only when it is aligned to "
                         f"{JAX_ALIGNMENT} bytes, and this Buffer starts "
                         f"{buf.ptr % JAX_ALIGNMENT} bytes past a boundary (offset "
                         f"{buf.offset}): JAX would copy it off the pool. Use a view offset "
                         f"that is a multiple of {JAX_ALIGNMENT}, or allow_copy=True")


def from_buffer(buf: Buffer, allow_copy: bool = False) -> Any:
    """``jax.dlpack.from_dlpack(buf)`` after :func:`check_importable`: a JAX array on the
    Buffer's memory (the array takes over the block).

    JAX (jaxlib up to at least 0.7) asks for the legacy capsule, which cannot carry a
    read-only Buffer: export a writable view to JAX instead (its arrays are immutable).
    """
    check_importable(buf, allow_copy)
    import jax.dlpack
    return jax.dlpack.from_dlpack(buf)


def from_pool(pool: Pool, shape: int | tuple[int, ...], dtype: Any = "float32",
              stream: Any = None) -> Any:
    """A new, uninitialised JAX array on `pool`'s memory (``pool.empty`` + hand-off)."""
    from mempool import _core
    from mempool._errors import require_instance
    require_instance(pool, _core.Pool, "pool")
    return from_buffer(pool.empty(shape, dtype, stream=stream))
