"""Zero-copy hand-off of pool memory to JAX through DLPack, and JAX sharing the device pool.

    python examples/jax_handoff.py [--backend cuda|host]

``mempool.jax.configure()`` (before JAX starts) turns off JAX's 75% preallocation and makes
it allocate from the device's default cudaMemPool (``cuda_async``), the one a
``Pool(backend="cuda", pool_handle="default")`` draws from. ``jax.dlpack.from_dlpack(buf)``
then views pool memory without a copy; JAX passes its stream, which mempool orders after the
buffer's. On ``--backend host`` the same hand-off runs on JAX's CPU backend.
"""
import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy                        # noqa: E402

import mempool                      # noqa: E402
import mempool.jax as mj            # noqa: E402
from _common import parse_backend, report, require   # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_backend(__doc__.splitlines()[0], "host", argv)
    require("jax", "JAX", "'jax[cpu]'" if args.backend == "host" else "'jax[cuda12]'")
    if args.backend == "cuda":
        print("JAX environment:", mj.configure())
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    print(f"backend: {args.backend}; JAX devices: {jax.devices()}")
    if args.backend == "cuda":
        jnp.zeros(1).block_until_ready()      # JAX first (it sets the cudaMemPool's threshold)
        pool = mj.shared_pool(0)
    else:
        pool = mempool.Pool(backend="host", capacity="1GB")
    buf = pool.empty((512, 512), "float32")
    # Write it in place through the array interfaces (which do not take the buffer over).
    if args.backend == "cuda":
        import cupy
        cupy.asarray(buf)[:] = cupy.eye(512, dtype=cupy.float32)   # on buf.stream (default)
    else:
        numpy.asarray(buf)[:] = numpy.eye(512, dtype=numpy.float32)
    ptr = buf.ptr
    x = mj.from_buffer(buf)                   # the hand-off
    addr = x.unsafe_buffer_pointer()
    print(f"buffer at {ptr:#x}; JAX array at {addr:#x}; same memory: {addr == ptr}")

    @jax.jit   # type: ignore[untyped-decorator]
    def step(a: Any) -> Any:
        return jnp.tanh(a @ a.T).sum()

    print(f"jit result {float(step(x)):.4f}")
    report(pool, "the JAX array holds the block")
    misaligned = pool.empty(100, "float32").view((10,), offset=4)
    try:
        mj.from_buffer(misaligned)
    except ValueError as exc:
        print(f"refused as expected: {exc}")
    del x, misaligned, buf   # the Buffer holds the block too, until its last holder goes
    # The Python array is gone at once, but jaxlib lets go of the buffer (and DLPack's
    # deleter returns the block) from its own thread a moment after the computation that
    # read it, so the count can lag; wait for it, bounded. gc.collect() for jaxlib
    # versions whose arrays sit in a reference cycle.
    deadline = time.monotonic() + 10
    while pool.used_bytes() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.005)
    report(pool, "after the JAX array died")
    assert pool.used_bytes() == 0, "the JAX array's block did not come back"
    pool.check_invariants()
    return 0


if __name__ == "__main__":
    sys.exit(main())
