"""``python -m mempool demo``: the pool at work, on a real GPU when there is one and on the
simulated device otherwise."""
import argparse
import time

import mempool


def _pairs_ns(alloc, free, nbytes, pairs=20000):
    for _ in range(200):
        free(alloc(nbytes))
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        free(alloc(nbytes))
    return (time.perf_counter_ns() - t0) / pairs


def _latency(pool):
    print(f"allocation round trip (alloc + free from Python, {pool.backend}):")
    sizes = (512, 64 << 10, 1 << 20, 64 << 20)
    rows = [("mempool Pool.alloc/free", [_pairs_ns(pool.alloc, pool.free, n) for n in sizes])]
    if pool.backend == "cuda":
        import cupy
        cp_pool = cupy.cuda.MemoryPool()
        rows.append(("CuPy MemoryPool.malloc/del",
                     [_pairs_ns(cp_pool.malloc, lambda m: None, n) for n in sizes]))
        rt = cupy.cuda.runtime
        rows.append(("cudaMalloc/cudaFree", [_pairs_ns(rt.malloc, rt.free, n, 500) for n in sizes]))
    print(f"  {'':32}" + "".join(f"{_size(n):>12}" for n in sizes))
    for name, ns in rows:
        print(f"  {name:32}" + "".join(f"{v:>10.0f}ns" for v in ns))


def _size(n):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _streams():
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = pool.alloc(1 << 20, stream=1)
    seq = dev.launch(1)                        # a kernel on stream 1 still uses a ...
    pool.free(a)                               # ... when a is freed
    b = pool.alloc(1 << 20, stream=2)          # stream 2 takes it over without a host sync:
    print("\nstream reuse on the simulated device:")
    print(f"  block {a:#x} freed on stream 1 with work pending; stream 2 got {b:#x}")
    print(f"  stream 2 ordered after stream 1's work: {dev.ordered(2, 1, seq)}; "
          f"host syncs: {dev.counters()['syncs']}")
    pool.free(b)


def _fragmentation():
    from mempool import replay, trace
    from mempool.cli_trace import default_trace
    try:
        path = default_trace()
    except FileNotFoundError as exc:   # the traces ship with a source checkout only
        print(f"\n(fragmentation replay skipped: {exc})")
        return
    events = trace.load_any(path)
    print(f"\nfragmentation replaying {path.rsplit('/', 1)[-1]} "
          f"({len(events):,} events; peak reserved / peak live, sim):")
    for label, opts in (("default", {}), ("expandable_segments", {"expandable_segments": True})):
        result = replay.replay(events, backend="sim", **opts)
        print(f"  {label:24} {result.ratio:.3f}  ({result.peak_live_bytes / 2**30:.2f} GiB live, "
              f"{result.peak_reserved_bytes / 2**30:.2f} GiB reserved)")


def main(command="demo", argv=()):
    parser = argparse.ArgumentParser(prog="python -m mempool demo", description=__doc__)
    parser.add_argument("--backend", choices=("cuda", "sim", "host"), default=None,
                        help="default: cuda when a GPU is usable, else sim")
    args = parser.parse_args(list(argv))
    from mempool import _cuda
    backend = args.backend or ("cuda" if _cuda.available() else "sim")
    print(f"mempool {mempool.__version__} demo on backend {backend!r}"
          + ("" if backend == "cuda" else " (no GPU in use: simulated device)"))
    pool = mempool.Pool(backend=backend)
    _latency(pool)
    _streams()
    _fragmentation()
    keep = [pool.alloc(n) for n in (1 << 10, 3 << 20, 40 << 20)]
    print()
    print(pool.summary())
    for p in keep:
        pool.free(p)
    return 0
