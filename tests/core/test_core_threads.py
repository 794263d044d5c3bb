"""Many threads on one pool: real host memory, each block filled with a pattern at allocation
and verified at free (seeded), in the manner of mimalloc's stress test."""
import ctypes
import random
import threading

import pytest

import mempool
from _support import run_threads

MiB = 1 << 20


def worker(pool, seed, rounds, errors, streams):
    rnd = random.Random(seed)
    live = []
    try:
        for _ in range(rounds):
            if live and rnd.random() < 0.45:
                ptr, n, byte, stream = live.pop(rnd.randrange(len(live)))
                if ctypes.string_at(ptr, n) != bytes([byte]) * n:
                    errors.append(f"block {ptr:#x} ({n} bytes) was overwritten")
                pool.free(ptr, stream=stream if rnd.random() < 0.5 else None)
            else:
                n = int(2 ** rnd.uniform(0, 22))
                stream = rnd.choice(streams)
                ptr = pool.alloc(n, stream=stream)
                byte = rnd.randrange(1, 256)
                ctypes.memset(ptr, byte, n)
                live.append((ptr, n, byte, stream))
        for ptr, n, byte, _ in live:
            if ctypes.string_at(ptr, n) != bytes([byte]) * n:
                errors.append(f"block {ptr:#x} ({n} bytes) was overwritten")
            pool.free(ptr)
    except Exception as exc:   # surfaced by the test thread below
        errors.append(repr(exc))


@pytest.mark.parametrize("options", [{}, {"release_threshold": 8 * MiB},
                                     {"expandable_segments": True},
                                     {"expandable_segments": True, "min_map_size": 16 * MiB,
                                      "release_threshold": 8 * MiB}], ids=str)
def test_threads_fill_and_verify(options):
    pool = mempool.Pool(backend="host", capacity=2 << 30, **options)
    errors = []
    streams = (0, 1, 2)
    run_threads(worker, [(pool, seed, 1500, errors, streams) for seed in range(6)])
    assert errors == []
    pool.check_invariants()
    assert pool.used_bytes() == 0
    pool.empty_cache()
    assert pool.reserved_bytes() == 0


def test_threads_on_the_simulated_device():
    pool = mempool.Pool(backend="sim")
    barrier = threading.Barrier(4)
    results = []

    def run(seed):
        rnd = random.Random(seed)
        barrier.wait()
        mine = []
        for _ in range(3000):
            if mine and rnd.random() < 0.5:
                pool.free(mine.pop(rnd.randrange(len(mine))))
            else:
                mine.append(pool.alloc(rnd.randrange(1, 1 << 21), stream=seed % 2))
        results.append(mine)

    run_threads(run, [(s,) for s in range(4)])
    ptrs = [p for mine in results for p in mine]
    assert len(ptrs) == len(set(ptrs))               # nothing handed out twice
    pool.check_invariants()
    for p in ptrs:
        pool.free(p)
    assert pool.used_bytes() == 0
