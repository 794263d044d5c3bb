"""CuPy, PyTorch, Numba (and JAX when installed) on one mempool pool, with one report.

    python examples/four_frameworks.py [--steps N]

One process, one pool on device 0:

- ``mempool.torch.install(pool)``: every PyTorch CUDA tensor comes from the pool;
- ``mempool.cupy.set_allocator(pool)``: every CuPy array;
- ``mempool.numba.install(pool)``: every Numba device array (its EMM plugin);
- JAX, when installed, reads a pool buffer through DLPack and allocates its own
  temporaries from the device's default cudaMemPool, which the pool draws its segments from
  too (``pool_handle="default"``, ``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``).

The work: training steps of a small MLP in PyTorch; a CuPy kernel over its activations
(zero-copy); a Numba kernel over the CuPy result into an array Numba allocates; a jitted
JAX function over a pool buffer. It prints what each framework took from the pool and the
pool's summary, and ends with one JSON line. Needs a GPU: every framework here allocates
device memory from a ``cuda`` pool, so on a machine without one it says so and stops.
"""
import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (first_line, gpu_available, numpy_names_for_numba, size_text,  # noqa: E402
                     train_mlp)

BATCH, WIDTH, HIDDEN = 512, 1024, 4096
NEEDED = {"cupy": "pip install cupy-cuda12x", "torch": "pip install torch",
          "numba.cuda": "pip install numba-cuda"}


def _missing() -> list[str]:
    import importlib.util
    out = []
    for module, hint in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            out.append(f"{module} ({hint})")
    return out


def run(steps: int) -> None:
    try:
        import jax
    except ImportError:
        jax = None
    pool_options = {}
    if jax is not None:
        # Before JAX's backend starts (mempool.jax): no preallocation, the default cudaMemPool.
        import mempool.jax
        mempool.jax.configure()
        import jax.numpy as jnp
        jnp.zeros(1).block_until_ready()
        pool_options["pool_handle"] = "default"

    import mempool
    import mempool.cupy
    import mempool.numba
    import mempool.torch
    pool = mempool.Pool(backend="cuda", device=0, **pool_options)
    mempool.torch.install(pool)         # before PyTorch touches CUDA
    mempool.numba.install(pool)         # before Numba makes its context
    mempool.cupy.set_allocator(pool)

    import cupy
    import numpy
    import torch
    from numba import cuda

    phases = []

    def mark(name: str) -> None:
        st = pool.stats()
        phases.append((name, st["allocation.all.allocated"], st["allocated_bytes.all.allocated"]))

    mark("start")
    _, act = train_mlp(torch, steps, BATCH, WIDTH, HIDDEN)
    mark("PyTorch")

    square_pos = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x > 0 ? x * x : 0",
                                        "square_pos")
    energy_map = square_pos(cupy.from_dlpack(act))
    energy = float(energy_map.sum(dtype=cupy.float64))
    mark("CuPy")

    @cuda.jit   # type: ignore[untyped-decorator]
    def scale_rows(src: Any, factor: float, dst: Any) -> None:
        i, j = cuda.grid(2)
        if i < src.shape[0] and j < src.shape[1]:
            dst[i, j] = src[i, j] * factor

    src = cuda.as_cuda_array(energy_map)                 # CuPy's pool block, zero-copy
    dst = cuda.device_array(src.shape, dtype=numpy.float32)   # from the pool (the plugin)
    scale_rows[(src.shape[0] // 16 + 1, src.shape[1] // 16 + 1), (16, 16)](src, 0.5, dst)
    numba_sum = float(cupy.asarray(dst).sum(dtype=cupy.float64))
    dst_on_pool = pool.block_info(dst.__cuda_array_interface__["data"][0])[0] > 0
    mark("Numba")

    jax_value = None
    if jax is not None:
        import jax.numpy as jnp
        buf = pool.empty(tuple(act.shape), "float32",
                         stream=torch.cuda.current_stream().cuda_stream)
        torch.from_dlpack(buf.view()).copy_(act)
        f = jax.jit(lambda a: jnp.tanh(a[:, :512] @ a[:, :512].T).mean())
        jax_value = float(f(mempool.jax.from_buffer(buf)))
        mark("JAX")

    torch.cuda.synchronize()
    per = {}
    for (_, n0, b0), (name, n1, b1) in zip(phases, phases[1:]):
        per[name] = {"allocations": n1 - n0, "bytes": b1 - b0}
    st = pool.stats()
    print("== one pool, four frameworks (device 0)")
    for name, d in per.items():
        print(f"   {name:<8} {d['allocations']:6d} allocations from the pool, {size_text(d['bytes'])}")
    if jax is None:
        print("   JAX      not installed: skipped (pip install jax[cuda12])")
    print(f"   Numba's output array is a pool block: {dst_on_pool}")
    print(f"   pool: peak reserved {size_text(st['reserved_bytes.all.peak'])}, reserved now "
          f"{size_text(pool.reserved_bytes())}, used now {size_text(pool.used_bytes())}")
    print(f"   checks: energy {energy:.6g}, Numba half-energy {numba_sum:.6g} "
          f"(agree: {abs(numba_sum - energy / 2) <= 1e-3 * energy})")
    print(pool.summary(abbreviated=True))
    pool.check_invariants()
    print(json.dumps({"per_framework": per, "numba_on_pool": dst_on_pool,
                      "energy": energy, "numba_sum": numba_sum, "jax": jax_value,
                      "pool_reserved_peak": st["reserved_bytes.all.peak"],
                      "torch_counters": mempool.torch.counters(0)}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if not gpu_available():
        print("four_frameworks: needs a GPU. CuPy, PyTorch, Numba and JAX allocate device "
              "memory here from one cuda pool, and this machine has no usable CUDA device "
              "(CuPy and PyTorch see none); nothing was run.")
        return 0
    missing = _missing()
    if missing:
        print(f"four_frameworks: needs {', '.join(missing)}; nothing was run.")
        return 0
    numpy_names_for_numba()
    for module in NEEDED:
        try:
            __import__(module)
        except Exception as error:   # noqa: BLE001 - installed, but broken here
            print(f"four_frameworks: {module} is installed but fails to import here "
                  f"({first_line(error)}); nothing was run.")
            return 0
    run(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
