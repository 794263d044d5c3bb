"""Where a ``torch.empty`` + drop through ``mempool.torch.install`` spends its time, in a
fresh process (PyTorch picks its allocator once per process).

    python mempool/bench/torch_empty_probe.py [--tree DIR] [--options JSON] [--pairs N]

Prints one JSON object: the median ns of a ``torch.empty(512, uint8)`` + drop over 5 rounds;
the same pair of PyTorch entry points called through ctypes (mostly ctypes' own cost: a
floor for comparison, not a figure of the pool); the pool's ``alloc``/``free`` from Python;
and every counter of ``pool.stats()`` that moved during the timed rounds, per pair (so a
path that reaches the upstream on every pair shows as ``segment.*`` counts near 1).
``--tree`` imports mempool from another checkout (built in place), to put two commits side
by side on one machine; ``--options`` are Pool keyword arguments, e.g.
``'{"release_threshold": 4611686018427387904}'``.
"""
import argparse
import ctypes
import json
import statistics
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", help="a mempool checkout to import instead of the installed one")
    parser.add_argument("--options", default="{}", help="Pool keyword arguments, as JSON")
    parser.add_argument("--pairs", type=int, default=20000)
    args = parser.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch

    import mempool
    import mempool.torch

    options = json.loads(args.options)
    pool = mempool.Pool(backend="cuda", device=0, **options)
    mempool.torch.install(pool)
    empty, uint8, pairs = torch.empty, torch.uint8, args.pairs

    def torch_pairs():
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            empty(512, dtype=uint8, device="cuda")
        return (time.perf_counter_ns() - t0) / pairs

    torch_pairs()                                   # warm-up
    before = pool.stats()
    rounds = [torch_pairs() for _ in range(5)]
    after = pool.stats()
    moved = {key: (after[key] - before[key]) / (5 * pairs) for key in after
             if isinstance(after[key], (int, float)) and after[key] != before[key]}

    lib = ctypes.CDLL(mempool.torch.library_path())
    alloc, free = lib.mempool_torch_alloc, lib.mempool_torch_free
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        free(alloc(512, 0, None), 512, 0, None)
    ctypes_ns = (time.perf_counter_ns() - t0) / pairs

    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        pool.free(pool.alloc(512, 0))
    pool_ns = (time.perf_counter_ns() - t0) / pairs

    print(json.dumps({"tree": args.tree or mempool.__file__, "options": options,
                      "torch_empty_ns": statistics.median(rounds),
                      "ctypes_entry_points_ns": ctypes_ns, "pool_alloc_free_ns": pool_ns,
                      "stats_moved_per_pair": moved}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
