"""``python -m mempool demo``: the pool at work, on a real GPU when there is one and on the
simulated device otherwise.

Every figure printed says what it measures and which way is better; on the simulated device
the demo also says what a GPU shows instead, since a simulated upstream costs nothing like a
driver call.
"""
import time

import mempool
from mempool import _config
from mempool._units import format_bytes
from mempool.cli._args import ArgumentParser

SIZES = (512, 64 << 10, 1 << 20, 64 << 20)

# What the demo's device is, said after the backend's name.
_BACKEND_NOTE = {"cuda": "", "sim": " (no GPU in use: simulated device)",
                 "host": " (no GPU in use: host memory)"}


def _pairs_ns(alloc, free, nbytes, pairs=20000):
    for _ in range(200):
        free(alloc(nbytes))
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        free(alloc(nbytes))
    return (time.perf_counter_ns() - t0) / pairs


def _rows(pool):
    """(label, [ns per pair by size]) of everything this backend can compare with."""
    rows = []
    if pool.backend != "cuda":
        # Two calls of a C method doing nothing: what any alloc + free from Python pays.
        d = {}
        rows.append(("two empty C-method calls (the floor)",
                     [_pairs_ns(d.get, d.get, n) for n in SIZES]))
    rows.append(("mempool Pool.alloc + free", [_pairs_ns(pool.alloc, pool.free, n)
                                               for n in SIZES]))
    if pool.backend == "cuda":
        import cupy
        cp_pool = cupy.cuda.MemoryPool()
        rows.append(("CuPy MemoryPool.malloc + del",
                     [_pairs_ns(cp_pool.malloc, lambda m: None, n) for n in SIZES]))
        rt = cupy.cuda.runtime
        rows.append(("cudaMalloc + cudaFree", [_pairs_ns(rt.malloc, rt.free, n, 500)
                                               for n in SIZES]))
    else:
        # release_threshold=0 gives every freed segment back: each pair is a segment
        # allocated from and returned to the upstream, the shape of cudaMalloc + cudaFree.
        upstream = mempool.Pool(backend=pool.backend, release_threshold=0)
        rows.append((f"upstream round trip ({pool.backend}, as cudaMalloc)",
                     [_pairs_ns(upstream.alloc, upstream.free, n, 2000) for n in SIZES]))
    return rows


def _latency(pool):
    print(f"\nallocation round trip: ns per allocate + free pair from Python, {pool.backend} "
          "(median of 20,000; lower is better)")
    rows = _rows(pool)
    width = max(len(name) for name, _ in rows) + 2
    print(f"  {'':{width}}" + "".join(f"{format_bytes(n):>12}" for n in SIZES))
    for name, ns in rows:
        print(f"  {name:{width}}" + "".join(f"{v:>9,.0f} ns" for v in ns))
    if pool.backend != "cuda":
        what = "fake addresses" if pool.backend == "sim" else "host address space"
        print(f"  On {pool.backend} the upstream hands out {what}, so its round trip is "
              "bookkeeping only.\n  On a GPU it is a driver call, and the gap is what a pool "
              "saves: BENCHMARKS.md has each allocator\n  measured side by side, and "
              "`python -m mempool bench` measures them on this machine's GPU.")


def _streams():
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = pool.alloc(1 << 20, stream=1)
    seq = dev.launch(1)                        # a kernel on stream 1 still uses a ...
    pool.free(a)                               # ... when a is freed
    b = pool.alloc(1 << 20, stream=2)          # stream 2 takes it over without a host sync:
    print("\nstream reuse (simulated device): a 1.00 MiB block freed on stream 1 while a "
          "kernel there still uses it")
    print(f"  stream 2 asked for 1.00 MiB and got {'the same block' if b == a else 'another block'}"
          f" ({b:#x}), ordered after stream 1's kernel by an event: "
          f"{dev.ordered(2, 1, seq)}")
    print(f"  host synchronizations: {dev.counters()['syncs']} (fewer is better: each one "
          "stalls the CPU until the GPU catches up)")
    pool.free(b)


def _fragmentation():
    from mempool.tools import replay, trace
    from mempool.cli.trace import default_trace
    path = default_trace()
    events = trace.load_any(path)
    print(f"\nfragmentation: replaying the shipped {path.rsplit('/', 1)[-1]} ({len(events):,} "
          "events, a transformer's training steps) on sim")
    print("  peak reserved / peak live: memory the pool held over memory the program used "
          "(1.000 = no waste; lower is better)")
    for label, opts in (("default", {}), ("expandable_segments", {"expandable_segments": True})):
        result = replay.replay(events, backend="sim", **opts)
        print(f"  {label:24} {result.ratio:.3f}  ({format_bytes(result.peak_live_bytes)} "
              f"live, {format_bytes(result.peak_reserved_bytes)} reserved)")


def main(command="demo", argv=()):
    parser = ArgumentParser(prog="python -m mempool demo", description=__doc__)
    parser.add_argument("--backend", choices=_config.BACKENDS, default=None,
                        help="default: cuda when a GPU is usable, else sim")
    args = parser.parse_args(list(argv))
    from mempool import _cuda
    backend = args.backend or ("cuda" if _cuda.available() else "sim")
    print(f"mempool {mempool.__version__} demo on backend {backend!r}"
          + _BACKEND_NOTE[backend])
    pool = mempool.Pool(backend=backend)
    _latency(pool)
    _streams()
    _fragmentation()
    sizes = (1 << 10, 3 << 20, 40 << 20)
    pool = mempool.Pool(backend=backend)      # a fresh one: the counts are these blocks'
    keep = [pool.alloc(n) for n in sizes]
    print(f"\nmemory summary of the demo's pool on {backend}, holding three blocks ("
          + ", ".join(format_bytes(n) for n in sizes) + "), in torch.cuda.memory_summary()'s "
          "layout:")
    print(pool.summary(abbreviated=True))
    for p in keep:
        pool.free(p)
    return 0
