"""What trace recording costs on the allocate/free path.

Recording is one hook in the core: a pointer that is NULL unless ``record_history`` is on,
so a pool whose recording was switched off runs exactly the code of a pool that never
recorded. These benchmarks show it: an alloc+free pair of 4 KiB (a cache hit, the hot
path) on the simulated device, timed from Python (``pool.alloc`` + ``pool.free``) and in C
(``bench_core_roundtrips``: mp_alloc + mp_free with no interpreter in the loop), with
recording

- ``never``: never enabled,
- ``off``: enabled, then disabled,
- ``on``: enabled, a ring of 65,536 entries (three entries per pair: alloc,
  free_requested, free_completed).

Run ``pytest mempool/bench/test_tracing_overhead.py --benchmark-enable`` for pytest-benchmark's
tables, and ``-s`` to print the interleaved comparison (``test_tracing_off_side_by_side``),
which times the pools side by side with a second never-enabled pool as the control for the
noise, and reports how far ``off`` is from ``never`` (a figure, not a pass/fail: timings
belong to the benchmark, and a busy machine moves them by a few percent). What can be
checked exactly (a switched-off pool records nothing and decides as one that never
recorded) is tests/core/test_observability.py's. On a GPU it also runs on the cuda backend.
"""
import gc
import statistics
import time

import pytest

import mempool

from .benchkit import PAIRS_AS_TEST

SIZE = 4096
PAIRS = 2000
RING = 1 << 16


def make_pool(tracing, backend="sim"):
    pool = mempool.Pool(backend=backend)
    if tracing in ("off", "on"):
        pool.record_history(enabled=True, max_entries=RING)
    if tracing == "off":
        pool.record_history(enabled=False)
    pool.free(pool.alloc(SIZE))              # the segment exists before timing starts
    return pool


def pairs(pool, n):
    alloc, free = pool.alloc, pool.free
    for _ in range(n):
        free(alloc(SIZE))


def c_pairs(pool, n):
    from mempool._core import bench_core_roundtrips
    return bench_core_roundtrips(pool, SIZE, n)


LEVELS = {"python": (pairs, PAIRS), "c": (c_pairs, 20 * PAIRS)}


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("tracing", ["never", "off", "on"])
def test_alloc_free_pair(benchmark, level, tracing):
    pool = make_pool(tracing)
    loop, n = LEVELS[level]
    done = [0]

    def round_():
        loop(pool, n)
        done[0] += n

    benchmark.group = f"alloc+free pair, 4 KiB, sim, from {level}: {n} pairs a round"
    benchmark.extra_info.update(tracing=tracing, level=level, pairs_per_round=n)
    benchmark.pedantic(round_, rounds=15, iterations=1, warmup_rounds=2)
    # What was recorded: nothing unless on; on, three entries a pair (the ring wraps).
    recorded = len(pool.history())
    assert recorded == (min(RING, 4 + 3 * done[0]) if tracing == "on" else 0)
    assert pool.stats()["num_device_alloc"] == 1


def _backend(name):
    if name == "cuda":
        from .benchkit import require_gpu
        require_gpu()
    return name


@pytest.mark.parametrize("backend", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("level", list(LEVELS))
def test_tracing_off_side_by_side(benchmark, level, backend):
    """Interleaved: each repetition times every pool once, in rotating order, so that
    drift of the machine hits all alike; a second never-enabled pool is the control that
    shows the noise. Ratios are taken per repetition (pools timed side by side) and kept in
    extra_info. A figure, not a pass/fail: what switching recording off must do exactly
    (record nothing, change no decision) is tests/core/test_observability.py's to check. Under
    --benchmark-disable it runs two short repetitions, as every benchmark runs once."""
    names = ("never", "control", "off", "on")
    pools = {t: make_pool("never" if t == "control" else t, _backend(backend))
             for t in names}
    loop, n = LEVELS[level]
    reps = 60
    if benchmark.disabled:
        reps, n = 2, PAIRS_AS_TEST

    def ns_per_pair(pool):
        t0 = time.perf_counter_ns()
        loop(pool, n)
        return (time.perf_counter_ns() - t0) / n

    times = {t: [] for t in names}

    def interleaved():
        for pool in pools.values():
            ns_per_pair(pool)                 # warm
        gc.disable()
        try:
            for rep in range(reps):
                k = rep % len(names)
                for t in names[k:] + names[:k]:
                    times[t].append(ns_per_pair(pools[t]))
        finally:
            gc.enable()

    benchmark.group = f"tracing side by side, 4 KiB, {backend}, from {level}"
    benchmark.pedantic(interleaved, rounds=1, iterations=1)

    def ratio(t):   # median over repetitions of t's time / never's time
        return statistics.median(a / b for a, b in zip(times[t], times["never"]))

    best = {t: min(v) for t, v in times.items()}
    median = {t: statistics.median(v) for t, v in times.items()}
    noise, off, on = ratio("control") - 1, ratio("off") - 1, ratio("on") - 1
    extra = best["on"] - best["never"]       # the work itself: best against best
    benchmark.extra_info.update(level=level, backend=backend, reps=reps, pairs_per_rep=n,
                                best_ns=best, median_ns=median, noise=noise, off_vs_never=off,
                                on_vs_never=on, recording_ns_per_pair=extra)
    print(f"\nns per alloc+free pair of {SIZE} B from {level}, {backend} "
          f"({reps} x {n} pairs):")
    for t in names:
        print(f"  {t:8} best {best[t]:7.1f}   median {median[t]:7.1f}")
    print(f"  control vs never {100 * noise:+.1f}% (the noise), off vs never {100 * off:+.1f}%, "
          f"on vs never {100 * on:+.1f}%; recording costs {extra:.0f} ns a pair, "
          f"{extra / 3:.0f} ns an entry")
