"""CuPy allocating from a mempool pool through its allocator hook.

    python examples/cupy_hook.py [--backend cuda|sim]

On a GPU, CuPy arrays (and the temporaries of its kernels) come from the pool while the
``with mempool.cupy.use(pool)`` block is active, on CuPy's current stream. Without a GPU
(``--backend sim``) the example shows the hook itself: ``pool.malloc`` returns the
``cupy.cuda.MemoryPointer`` CuPy would get, and dropping it returns the block.
"""
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mempool                      # noqa: E402
import mempool.cupy as mc           # noqa: E402
from _common import parse_backend, report, require   # noqa: E402


def on_gpu(stream: Any) -> None:
    import cupy
    pool = mempool.Pool(backend="cuda", device=0)
    with mc.use(pool):
        x = cupy.arange(1 << 22, dtype=cupy.float32)       # 16 MiB from the pool
        y = cupy.sqrt(x) * 2 + 1                           # temporaries too
        with stream:                                       # allocated on `stream`
            z = cupy.ones((2048, 2048), dtype=cupy.float32) @ cupy.ones((2048, 2048),
                                                                         dtype=cupy.float32)
        stream.synchronize()
        total = float(y.sum()) + float(z[0, 0])
        report(pool, "while CuPy holds x, y, z")
        del x, y, z
    report(pool, "after CuPy freed them (cached for reuse)")
    arr = mc.from_pool(pool, (1024, 1024), "float64")      # outside the hook, explicitly
    arr.fill(1.5)
    print(f"   from_pool array on the pool: {arr.data.ptr:#x}, sum {float(arr.sum())}")
    print(f"   checksum {total:.6g}")
    pool.check_invariants()


def on_sim() -> None:
    pool = mempool.Pool(backend="sim", capacity="80GB")
    ptrs = [pool.malloc(n) for n in (512, 1 << 20, 64 << 20)]
    for mp in ptrs:
        print(f"   MemoryPointer ptr={mp.ptr:#x} size={mp.mem.size}")
    report(pool, "three MemoryPointers alive")
    del mp
    ptrs.clear()
    report(pool, "after dropping them")
    pool.check_invariants()


def main(argv: list[str] | None = None) -> int:
    args = parse_backend(__doc__.splitlines()[0], "sim", argv)
    # pool.malloc builds CuPy's MemoryPointer, so CuPy is needed even on sim (it imports
    # without a GPU).
    require("cupy", "CuPy", "cupy-cuda12x")
    print(f"backend: {args.backend}")
    if args.backend == "cuda":
        import cupy
        # Made before the pool and dropped after it: the pool keeps segments made on a
        # stream until it goes, and they must be freed on a live stream.
        stream = cupy.cuda.Stream(non_blocking=True)
        on_gpu(stream)
    else:
        on_sim()
    return 0


if __name__ == "__main__":
    sys.exit(main())
