"""What every benchmark of the suite shares: sizes, run lengths, the GPU probe, the timer.

Run lengths follow ANCHORS.md: 2000 malloc+free pairs a round in a tight loop, 7 rounds, the
median reported per pair. ``MEMPOOL_BENCH_QUICK=1`` (``python -m mempool bench --quick``)
shortens them. Under ``--benchmark-disable`` (CI) each benchmark runs its loop once as a plain
test with a few pairs, and the large setups shrink (see ``live_count``).
"""
import functools
import os

import numpy as np
import pytest

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

SIZES = {"512 B": 512, "64 KiB": 64 * KiB, "1 MiB": MiB, "64 MiB": 64 * MiB}
MIX_MIN, MIX_MAX, MIX_LIVE = 512, 256 * MiB, 32
MIX = f"mix 512 B-256 MiB, {MIX_LIVE} live"
SEED = 20251202

QUICK = os.environ.get("MEMPOOL_BENCH_QUICK") == "1"
PAIRS = 500 if QUICK else 2000
ROUNDS = 3 if QUICK else 7
PAIRS_AS_TEST = 20          # under --benchmark-disable: one short pass
LIVE_AS_TEST = 10_000       # under --benchmark-disable: cap on pre-filled live blocks

SIM_CAPACITY = 256 << 30    # sim addresses are fake: room for 10^6 live blocks, the mix, ... 


@functools.lru_cache(maxsize=None)
def gpu_available():
    """True when a CUDA device can be used: the Pool's own probe (``mempool._cuda.available``),
    asked once per process."""
    from mempool import _cuda

    return _cuda.available()


NO_GPU = "needs a CUDA device; none found"
# For parameters and tests that need the device: skipped cleanly without one.
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason=NO_GPU)]


def require_gpu():
    if not gpu_available():
        pytest.skip(NO_GPU)


def pairs_for(benchmark):
    return PAIRS_AS_TEST if benchmark.disabled else PAIRS


def live_count(benchmark, n):
    """`n` live blocks for a timed run; capped when the benchmark runs once as a test."""
    return min(n, LIVE_AS_TEST) if benchmark.disabled else n


def log_uniform_sizes(n, lo, hi, seed=SEED):
    """`n` seeded sizes drawn log-uniformly from [lo, hi] bytes, as Python ints."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.exp(rng.uniform(np.log(lo), np.log(hi), n)).round()]


def measure(benchmark, loop, per_round, *, section, row, column, group=None, ref=None,
            backend=None, unit="pair", args=None, setup=None, **info):
    """Time ``loop(*args)`` ROUNDS times and record the median per `unit` in extra_info.

    `per_round` is how many units (pairs, events) one call of `loop` does. `section`, `row`
    and `column` place the figure in the suite's summary table; `ref` marks a mempool row
    that ratios may be taken against (lower rank wins). Compiled loops return their own
    elapsed nanoseconds; that figure is kept too, as ``inner_ns_per_<unit>``.
    """
    benchmark.group = group or f"{section}: {column}"
    benchmark.extra_info.update(section=section, row=row, column=column, unit=unit,
                                per_round=per_round, ref=ref, backend=backend, **info)
    inner = []

    def timed(*a):
        result = loop(*a)
        if isinstance(result, int):
            inner.append(result)
        return result

    kwargs = dict(rounds=ROUNDS, warmup_rounds=1, iterations=1)
    if setup is not None:
        kwargs["setup"] = setup
    else:
        kwargs["args"] = (per_round,) if args is None else args
    result = benchmark.pedantic(timed, **kwargs)
    if not benchmark.disabled:
        stats = benchmark.stats.stats
        benchmark.extra_info["ns"] = stats.median * 1e9 / per_round
        benchmark.extra_info[f"ns_per_{unit}"] = benchmark.extra_info["ns"]
        benchmark.extra_info[f"min_ns_per_{unit}"] = stats.min * 1e9 / per_round
        if inner:
            benchmark.extra_info[f"inner_ns_per_{unit}"] = float(np.median(inner)) / per_round
    return result


def child_env():
    """The child's environment: this mempool importable, from the folder that holds the
    package (never the package's own folder, where ``import torch`` would find
    mempool/torch.py instead of PyTorch)."""
    import mempool
    holder = os.path.dirname(os.path.dirname(os.path.abspath(mempool.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([holder, os.environ.get("PYTHONPATH", "")]))
