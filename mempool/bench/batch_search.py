"""The search of bench/largest_batch.py: the largest batch that replays with no OOM under a
limit, for any workload given as ``traces(batch) -> mempool.tools.replay.Prepared``.

Kept in the package, apart from the script's workload (bench/make_traces.py) and its PyTorch
rows, so that the tests import it by name. See bench/largest_batch.py for the method.
"""
from __future__ import annotations

import time

from mempool.tools import replay as rp

MEMPOOL_CONFS = [
    ("mempool default", {}),
    ("mempool expandable_segments:True", {"expandable_segments": True}),
    # No segment_rounding row: under the limit every fixed segment is plain (Note [Segment
    # rounding]), so it would be the default row again, on sim and on cuda.
    ("mempool roundup_power2_divisions:4", {"roundup_power2_divisions": 4}),
    ("mempool max_split_size:64MB", {"max_split_size": 64 << 20}),
]
MAX_BATCH = 4096
CHECK_ABOVE = 2


# ---------------------------------------------------------------------------------------
# the search


def search(trial, start: int, max_batch: int, check_above: int = CHECK_ABOVE) -> dict:
    """The largest batch for which ``trial(batch)["fits"]``, in 1..max_batch.

    Gallops from `start` (up while batches fit, down while they do not, the step doubling
    each time), bisects between the highest fit and the lowest failure, then tries the
    `check_above` batches above that boundary (up to `max_batch`), since fitting need not be
    monotone. Returns ``largest`` (the largest batch that fitted among all tried, None if
    none did), ``boundary`` (where the bisection ended: 0 if no batch fitted) and ``trials``
    (each trial's dict, in the order tried).
    """
    trials = {}

    def fits(batch):
        if batch not in trials:
            trials[batch] = trial(batch)
        return trials[batch]["fits"]

    start = max(1, min(start, max_batch))
    lo, hi, step = None, None, 1       # lo fitted, hi did not
    if fits(start):
        lo = start
        while hi is None and lo < max_batch:
            b = min(lo + step, max_batch)
            if fits(b):
                lo = b
            else:
                hi = b
            step *= 2
    else:
        hi = start
        while lo is None and hi > 1:
            b = max(hi - step, 1)
            if fits(b):
                lo = b
            else:
                hi = b
            step *= 2
        if lo is None:
            lo = 0                     # not even batch 1 fits
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if lo:
        for b in range(lo + 1, min(lo + check_above, max_batch) + 1):
            fits(b)
    fitted = [b for b, t in trials.items() if t["fits"]]
    return {"largest": max(fitted, default=None), "boundary": lo,
            "trials": list(trials.values())}


def live_bound(traces, limit: int, max_batch: int = MAX_BATCH) -> dict:
    """The largest batch whose live bytes alone fit `limit`: no allocator can fit more, since
    every live byte is a reserved byte and the limit caps reserved bytes."""
    def trial(batch):
        live = traces(batch).peak_live_bytes
        return {"batch": batch, "fits": live <= limit, "needed_live_bytes": live}

    return search(trial, 1, max_batch, check_above=0)


def mempool_trial(traces, conf: dict, limit: int, backend: str, **options):
    """One batch replayed through a fresh mempool Pool capped at `limit`."""
    def trial(batch):
        prep = traces(batch)
        t0 = time.perf_counter()
        r = rp.replay(prep, conf=dict(conf), backend=backend, limit=limit, check=True,
                      **options)
        return {"batch": batch, "fits": r.num_ooms == 0, "num_ooms": r.num_ooms,
                "needed_live_bytes": prep.peak_live_bytes,
                "peak_live_bytes": r.peak_live_bytes,       # less than needed under OOMs
                "peak_reserved_bytes": r.peak_reserved_bytes,
                "seconds": round(time.perf_counter() - t0, 3)}

    return trial



def _sim_options(backend: str, limit: int) -> dict:
    """On sim, a device at least as large as the limit, so that the limit is what binds."""
    if backend != "sim":
        return {}
    import mempool

    capacity = mempool.Pool(backend="sim").capacity
    return {} if limit <= capacity else {"capacity": limit}


def _cuda_available() -> bool:
    try:
        from mempool import _cuda
        return _cuda.available()
    except Exception:  # noqa: BLE001 - any failure to reach the driver means no device
        return False


def mempool_rows(traces, limit: int, backend: str, start: int, max_batch: int,
                 check_above: int = CHECK_ABOVE, confs=MEMPOOL_CONFS) -> list:
    if backend == "cuda" and not _cuda_available():
        return [{"allocator": label, "conf": conf,
                 "skipped": "backend cuda: no CUDA device (or no CuPy) found"}
                for label, conf in confs]
    options = _sim_options(backend, limit)
    rows = []
    for label, conf in confs:
        row = {"allocator": label, "conf": conf}
        try:
            row.update(search(mempool_trial(traces, conf, limit, backend, **options),
                              start, max_batch, check_above))
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows
