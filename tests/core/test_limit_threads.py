"""A limit holds for the memory underneath (Note [Releases in flight], mp_release.c): with
16 threads allocating and freeing under one limit, the upstream never holds more than the
limit at once, counting segments on their way back to it."""
import random
import threading

import pytest

import mempool
from _support import run_threads

MiB = 1 << 20
LIMIT = 64 * MiB
THREADS = 16


def worker(pool, seed, rounds, barrier, errors):
    rnd = random.Random(seed)
    live = []
    barrier.wait()
    try:
        for _ in range(rounds):
            if rnd.random() < 0.05:
                pool.empty_cache()   # releases in flight at any moment
            if live and (len(live) >= 2 or rnd.random() < 0.5):
                pool.free(live.pop(rnd.randrange(len(live))))
                continue
            try:
                live.append(pool.alloc(rnd.randrange(1, 24 * MiB)))
            except MemoryError:   # the limit refused: 16 threads may want more than 64 MiB
                pass
        for ptr in live:
            pool.free(ptr)
    except Exception as exc:   # surfaced by the test below
        errors.append(repr(exc))


@pytest.mark.parametrize("backend", ["sim", "host"])
def test_threads_keep_the_upstream_under_the_limit(backend):
    pool = mempool.Pool(backend=backend, limit=LIMIT)
    barrier = threading.Barrier(THREADS)
    errors = []
    run_threads(worker, [(pool, seed, 1000, barrier, errors) for seed in range(THREADS)])
    assert errors == []
    assert pool.stats()["reserved_bytes.all.peak"] <= LIMIT
    assert pool.device.peak_bytes <= LIMIT, \
        f"the upstream held {pool.device.peak_bytes / MiB:.1f} MiB at once under a 64 MiB limit"
    pool.check_invariants()
    assert pool.used_bytes() == 0
