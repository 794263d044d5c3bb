"""PyTorch, CuPy and JAX on one mempool pool, against each framework's own allocator.

    python examples/all_three.py [--steps N] [--mode both|mempool|native]

The same work runs twice, each time in a fresh process (PyTorch's allocator can only be
chosen before it initialises CUDA):

mempool
    ``mempool.torch.install(pool)``: every PyTorch CUDA tensor comes from the pool;
    ``mempool.cupy.set_allocator(pool)``: so does every CuPy array; JAX reads its input from
    a pool buffer through DLPack, and allocates its own temporaries from the device's default
    cudaMemPool (``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``), which the pool draws its
    segments from too (``pool_handle="default"``).
native
    PyTorch's caching allocator, CuPy's MemoryPool and JAX's BFC allocator (preallocation
    off, so it is a fair comparison), each caching for itself.

The work: a few training steps of an MLP in PyTorch; a CuPy elementwise kernel and a
reduction over the hidden activations; a jitted JAX function over a copy of them. It prints
the pool's accounting for all three frameworks, then the reserved bytes side by side.
Needs a GPU (CUDA PyTorch, CuPy and JAX); without one it says so and exits.
"""
import argparse
import json
import os
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import gpu_available, require, size_text, train_mlp   # noqa: E402

BATCH, WIDTH, HIDDEN = 1024, 2048, 8192


def run(mode: str, steps: int) -> None:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if mode == "mempool":
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "cuda_async"
    import jax
    import jax.numpy as jnp
    jnp.zeros(1).block_until_ready()          # JAX's backend first (see mempool.jax)
    pool = None
    if mode == "mempool":
        import mempool
        import mempool.cupy as mc
        import mempool.torch as mt
        pool = mempool.Pool(backend="cuda", device=0, pool_handle="default")
        mt.install(pool)
        mc.set_allocator(pool)
    import cupy
    import torch

    torch.manual_seed(0)
    free0, total = torch.cuda.mem_get_info(0)
    phases = {}

    def mark(name: str) -> None:
        if pool is not None:
            st = pool.stats()
            phases[name] = (st["allocation.all.allocated"], st["allocated_bytes.all.allocated"])

    # PyTorch: training steps; keep the last hidden activations.
    mark("start")
    loss, act = train_mlp(torch, steps, BATCH, WIDTH, HIDDEN)
    mark("torch")

    # CuPy: a kernel on PyTorch's activations, zero-copy (both on the current stream).
    square_pos = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x > 0 ? x * x : 0",
                                        "square_pos")
    cact = cupy.from_dlpack(act)
    energy = float(square_pos(cact).sum(dtype=cupy.float64))
    mark("cupy")

    # JAX: a jitted function over a copy of the activations handed over through DLPack.
    if pool is not None:
        buf = pool.empty(tuple(act.shape), "float32",
                         stream=torch.cuda.current_stream().cuda_stream)
        torch.from_dlpack(buf.view()).copy_(act)
        jx = jax.dlpack.from_dlpack(buf)
    else:
        jx = jax.dlpack.from_dlpack(act.clone())
    f = jax.jit(lambda a: jnp.tanh(a[:, :1024] @ a[:, :1024].T).mean())
    value = float(f(jx))
    mark("jax")

    torch.cuda.synchronize()
    cupy.cuda.Device().synchronize()
    free1, _ = torch.cuda.mem_get_info(0)
    jstats = jax.devices()[0].memory_stats() or {}
    out = {
        "mode": mode,
        "loss": float(loss), "energy": energy, "jax": value,
        "device_used": free0 - free1,
        "jax_peak": jstats.get("peak_bytes_in_use", 0),
        "jax_reserved": jstats.get("pool_bytes", jstats.get("bytes_reserved",
                                                            jstats.get("peak_bytes_in_use", 0))),
    }
    if pool is not None:
        st = pool.stats()
        names = ["torch", "cupy", "jax"]
        prev = phases["start"]
        per = {}
        for name in names:
            cur = phases[name]
            per[name] = {"allocations": cur[0] - prev[0], "bytes": cur[1] - prev[1]}
            prev = cur
        out.update({
            "pool_reserved_peak": st["reserved_bytes.all.peak"],
            "pool_reserved": pool.reserved_bytes(),
            "pool_used": pool.used_bytes(),
            "pool_allocated_peak": st["allocated_bytes.all.peak"],
            "per_framework": per,
            "torch_counters": mt.counters(0),
        })
        pool.check_invariants()
    else:
        out.update({
            "torch_reserved_peak": torch.cuda.max_memory_reserved(0),
            "torch_reserved": torch.cuda.memory_reserved(0),
            "cupy_reserved": cupy.get_default_memory_pool().total_bytes(),
        })
    print(json.dumps(out))


def table(results: dict[str, Any]) -> None:
    m, n = results["mempool"], results["native"]
    print("\n== one pool (mempool) ==")
    for name, d in m["per_framework"].items():
        print(f"   {name:<6} {d['allocations']:6d} allocations from the pool, {size_text(d['bytes'])}")
    print(f"   pool: peak reserved {size_text(m['pool_reserved_peak'])}, reserved now "
          f"{size_text(m['pool_reserved'])}, used now {size_text(m['pool_used'])}")
    print(f"   JAX's own temporaries (shared cudaMemPool): peak {size_text(m['jax_peak'])}")
    print("\n== reserved bytes, side by side (same work) ==")
    print(f"   {'':<28}{'mempool':>16}{'native':>16}")
    print(f"   {'PyTorch (peak)':<28}{'(in pool)':>16}{size_text(n['torch_reserved_peak']):>16}")
    print(f"   {'CuPy':<28}{'(in pool)':>16}{size_text(n['cupy_reserved']):>16}")
    print(f"   {'mempool pool (peak)':<28}{size_text(m['pool_reserved_peak']):>16}{'-':>16}")
    print(f"   {'JAX (peak)':<28}{size_text(m['jax_peak']):>16}{size_text(n['jax_reserved']):>16}")
    total_m = m["pool_reserved_peak"] + m["jax_peak"]
    total_n = n["torch_reserved_peak"] + n["cupy_reserved"] + n["jax_reserved"]
    print(f"   {'sum':<28}{size_text(total_m):>16}{size_text(total_n):>16}")
    print(f"   one pool reserves less than the three side by side: {total_m < total_n}")
    # The device's free bytes before and after the work: other processes on the GPU move
    # them too, and then the difference says nothing of this work.
    used = [size_text(r["device_used"]) if r["device_used"] >= 0 else "n/a" for r in (m, n)]
    print(f"   {'device memory in use':<28}{used[0]:>16}{used[1]:>16}")
    if "n/a" in used:
        print("   (n/a: other processes gave device memory back meanwhile)")
    same = all(abs(m[k] - n[k]) <= 1e-3 * max(1.0, abs(n[k])) for k in ("energy", "jax"))
    print(f"\n   results agree across modes: {same} (loss {m['loss']:.5f} vs {n['loss']:.5f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mode", choices=("both", "mempool", "native"), default="both")
    args = ap.parse_args(argv)
    if not gpu_available():
        # The point is three frameworks' device allocations on one pool: nothing on a CPU
        # stands for that (PyTorch's CPU allocator cannot be replaced).
        print("all_three.py: skipped, it needs a CUDA GPU (PyTorch, CuPy and JAX allocating "
              "on one device) and none was found here (on a GPU machine: pip install torch "
              "cupy-cuda12x 'jax[cuda12]')")
        return 0
    require("torch", "PyTorch with CUDA", "torch")
    require("cupy", "CuPy", "cupy-cuda12x")
    require("jax", "JAX with CUDA", "'jax[cuda12]'")
    if args.mode != "both":
        run(args.mode, args.steps)
        return 0
    results = {}
    for mode in ("mempool", "native"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode,
                               "--steps", str(args.steps)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return proc.returncode
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
