"""Replay an allocation trace through a Pool and measure what it reserves.

``replay(events, conf)`` runs every alloc and free of a trace (see :mod:`mempool.tools.trace`)
through a fresh :class:`mempool.Pool` and reports the peak live bytes (what the program
asked for), the peak reserved bytes (what the pool took from its upstream) and their ratio,
the OOMs, and the time per event. On ``backend="sim"`` nothing touches a device, so a trace
recorded on an 80 GiB GPU replays on a laptop, deterministically.

Speed: the events are converted once (:func:`prepare`) into a list of small tuples with the
trace's ids mapped to dense slots, so the replay loop is one tuple unpack and one Pool call
per event; :func:`mempool.tools.tune.tune` reuses one preparation for every setting it tries.
"""
from __future__ import annotations

import bisect
import operator
import os
import time
from dataclasses import dataclass, field
import numpy as np

from mempool._config import BACKENDS
from mempool.tools import trace as mtrace

__all__ = ["Prepared", "ReplayResult", "prepare", "replay", "pool_at", "peak_excess", "stretches",
           "emptying_ops", "partial_trims", "BACKENDS"]

TIMESERIES_POINTS = 2000
# What the pool asked of its upstream, from its stats: key in the result -> stats key.
# device_alloc / device_free are segment allocs and frees, or with expandable segments
# page maps and unmaps (each of mapped_bytes / unmapped_bytes in pages of the granularity).
UPSTREAM_COUNTERS = {"device_alloc": "num_device_alloc", "device_free": "num_device_free",
                     "mapped_bytes": "mapped_bytes.allocated",
                     "unmapped_bytes": "mapped_bytes.freed",
                     "stream_syncs": "num_stream_syncs", "event_records": "num_event_records",
                     "stream_waits": "num_event_waits", "stream_queries": "num_stream_queries"}
CALL_COUNTERS = ("device_alloc", "device_free", "stream_syncs", "event_records",
                 "stream_waits", "stream_queries")
_MAX_NBYTES = 1 << 63     # live bytes are summed in int64 (Prepared.deltas)


@dataclass
class Prepared:
    """A trace converted for fast replay (see :func:`prepare`)."""

    ops: list                 # (slot, nbytes, stream) alloc; (slot, 0, free_stream) free
    nslots: int               # most buffers live at once
    streams: list             # the trace's stream handles, by dense index (0 first)
    deltas: np.ndarray        # live-bytes change per op (int64)
    partner: np.ndarray       # for an alloc op, the index of its free op (-1: never freed)
    times_ns: np.ndarray      # time of each op (int64)
    events: int               # events in the input (ops add implicit frees of duplicates)
    allocs: int
    frees: int
    unknown_frees: int        # frees of ids with no live alloc: counted, not replayed
    duplicate_allocs: int     # allocs of an id already live: its earlier buffer is freed first
    step_ops: list | None = None   # op index where each training step begins (from the
                                   # trace's meta "step_starts"), None when unknown
    empty_cache_ops: list = field(default_factory=list)   # op indices before which the
                                   # program emptied the cache ("empty_cache" events), sorted
    trim_ops: list = field(default_factory=list)   # (op index, keep): before that op the
                                   # program called trim(keep) ("trim" events), in trace
                                   # order (so sorted)

    @property
    def peak_live_bytes(self) -> int:
        return int(np.cumsum(self.deltas).max(initial=0))


@dataclass
class ReplayResult:
    """What one replay measured. Byte figures are exact and deterministic on sim."""

    backend: str
    options: dict                     # the pool's resolved options
    events: int
    allocs: int
    frees: int
    peak_live_bytes: int              # most bytes the trace held at once (requested sizes)
    peak_reserved_bytes: int          # most bytes the pool held from its upstream
    peak_allocated_bytes: int         # most bytes in allocated blocks (after rounding)
    num_ooms: int                     # allocations refused; the replay went on without them
    unknown_frees: int
    duplicate_allocs: int
    num_device_alloc: int             # upstream segment allocations
    num_device_free: int
    ns_per_event: float               # wall time of the replay loop per event (with a time
                                      # series, its sampling included)
    first_oom: str | None = None      # the message of the first OutOfMemoryError
    empty_cache_calls: int = 0        # the trace's empty_cache events, replayed as the calls
    trim_calls: int = 0               # the trace's trim events, replayed as the calls (but
                                      # one right after an empty_cache: see prepare)
    timeseries: dict | None = None    # see replay(timeseries=True)
    stats: dict = field(default_factory=dict, repr=False)
    # Upstream calls the pool made, in all (``upstream``) and per training step (``steps``,
    # when the trace marks its steps; ``setup``: the events before the first), each a dict
    # of UPSTREAM_COUNTERS. See docs/expandable.md, "Where the time goes".
    upstream: dict | None = None
    setup: dict | None = None
    steps: list | None = None
    # cuda, segments from a cudaMemPool (no expandable segments): the most that pool held
    # from the device at once. With the pool's default release_threshold it keeps what the
    # Pool gives back until a trim (empty_cache), so this, not peak_reserved_bytes, is the
    # device memory the process held. None elsewhere.
    driver_reserved_peak_bytes: int | None = None

    @property
    def calls_per_step(self) -> list | None:
        """Upstream calls of each step: segment allocs or page maps, frees or unmaps,
        stream syncs, event records and waits, stream queries."""
        if self.steps is None:
            return None
        return [sum(step[k] for k in CALL_COUNTERS) for step in self.steps]

    @property
    def ratio(self) -> float:
        """Peak reserved / peak live (1.0 = no fragmentation or rounding overhead)."""
        return self.peak_reserved_bytes / self.peak_live_bytes if self.peak_live_bytes else 1.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stats"}
        d["ratio"] = self.ratio
        return d

    def __str__(self) -> str:
        from mempool._units import format_bytes as fb

        return (f"{self.events} events on {self.backend}: peak live "
                f"{fb(self.peak_live_bytes)}, peak reserved {fb(self.peak_reserved_bytes)}, "
                "reserved/live "
                f"{self.ratio:.3f}, {self.num_ooms} OOMs, {self.ns_per_event:.0f} ns/event")


def prepare(events) -> Prepared:
    """Convert events (an iterable of :class:`mempool.tools.trace.Event` or 5-tuples, or a
    trace file's path) for replay.

    Ids map to dense slots, reused once freed. A free of an id that is not live is counted
    in ``unknown_frees`` and dropped; an alloc of an id that is already live (a trace that
    lost a free) frees the earlier buffer first and is counted in ``duplicate_allocs``.
    An ``empty_cache`` event becomes an entry of ``empty_cache_ops``: the pool's
    ``empty_cache()`` runs there, between the ops around it. A ``trim`` event becomes an
    entry ``(op index, keep)`` of ``trim_ops``: the pool's ``trim(keep)`` runs there. Calls
    with no op between run in trace order, except that a call right after an ``empty_cache``
    is dropped: it would find nothing more to release (a second ``empty_cache`` is dropped
    alike).
    """
    if isinstance(events, Prepared):
        return events
    if isinstance(events, (str, os.PathLike)):
        # A file, in any format the trace module reads (as `python -m mempool replay` takes).
        events = mtrace.load_any(events)
    ops = []
    deltas = []
    times = []
    partner = []
    append_op, append_d, append_t, append_p = ops.append, deltas.append, times.append, partner.append
    live = {}                 # id -> (slot, op index, nbytes, stream index)
    spare = []                # free slots
    nslots = 0
    stream_index = {0: 0}
    streams = [0]
    n_events = allocs = frees = unknown = dups = 0
    empties = []
    trims = []
    starts = (getattr(events, "meta", None) or {}).get("step_starts")
    if isinstance(starts, list):
        mtrace.check_step_starts(starts, "prepare: meta")
    step_events = set(starts) if isinstance(starts, list) and starts else None
    step_ops = [] if step_events else None
    for ev in events:
        if step_events is not None and n_events in step_events:
            step_ops.append(len(ops))
        n_events += 1
        try:
            action, ident, nbytes, stream, t = ev
        except (TypeError, ValueError):
            raise ValueError(f"prepare: event {n_events - 1}: an event is a trace.Event or a "
                             f"5-tuple (action, id, nbytes, stream, time_ns); got "
                             f"{ev!r:.80}") from None
        try:
            s = stream_index.get(stream)
            hash(ident)
        except TypeError:
            raise ValueError(f"prepare: event {n_events - 1}: an event's id and stream are ints "
                             f"(an id may be a str); got id {ident!r:.40}, stream "
                             f"{stream!r:.40}") from None
        if s is None:
            s = stream_index[stream] = len(streams)
            streams.append(stream)
        if action == "alloc":
            # Live bytes are summed in int64: a size must be an int in (0, 2**63).
            try:
                size = operator.index(nbytes)
            except TypeError:
                size = 0
            if isinstance(nbytes, bool) or not 0 < size < _MAX_NBYTES:
                raise ValueError(f"prepare: event {n_events - 1}: an alloc needs nbytes, an int "
                                 f"in (0, 2**63); got {nbytes!r}")
            nbytes = size
            prev = live.pop(ident, None)
            if prev is not None:
                # The trace lost this buffer's free (an address cannot be live twice).
                dups += 1
                pslot, pidx, pn, _ = prev
                partner[pidx] = len(ops)
                append_op((pslot, 0, None)); append_d(-pn); append_t(t); append_p(-1)
                spare.append(pslot)
            if spare:
                slot = spare.pop()
            else:
                slot = nslots
                nslots += 1
            live[ident] = (slot, len(ops), nbytes, s)
            append_op((slot, nbytes, s)); append_d(nbytes); append_t(t); append_p(-1)
            allocs += 1
        elif action == "free":
            prev = live.pop(ident, None)
            if prev is None:
                unknown += 1
                continue
            slot, idx, pn, astream = prev
            partner[idx] = len(ops)
            # None frees on the block's own stream; a different stream is passed on.
            append_op((slot, 0, None if s == astream else s))
            append_d(-pn); append_t(t); append_p(-1)
            spare.append(slot)
            frees += 1
        elif action == "empty_cache":
            if ident != 0 or nbytes != 0:
                raise ValueError(f"prepare: event {n_events - 1}: an empty_cache event names no "
                                 f"buffer: its id and nbytes are 0; got id {ident!r}, nbytes "
                                 f"{nbytes!r}")
            if not empties or empties[-1] != len(ops):   # two in a row: the second is a no-op
                empties.append(len(ops))
        elif action == "trim":
            keep = mtrace._check_trim(ident, nbytes, f"prepare: event {n_events - 1}")
            if not empties or empties[-1] != len(ops):   # right after an empty_cache: a no-op
                trims.append((len(ops), keep))
        else:
            raise ValueError(f"prepare: event {n_events - 1}: action must be 'alloc', 'free', "
                             f"'empty_cache' or 'trim'; got {action!r}")
    try:
        times_ns = np.asarray(times, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        # The slow path of an error: name the first time that is not an int64.
        bad = next(t for t in times if not _fits_int64(t))
        raise ValueError(f"prepare: an event's time_ns is an int in [-2**63, 2**63); got "
                         f"{bad!r:.40}") from None
    return Prepared(ops=ops, nslots=nslots, streams=streams,
                    deltas=np.asarray(deltas, dtype=np.int64),
                    partner=np.asarray(partner, dtype=np.int64),
                    times_ns=times_ns,
                    events=n_events, allocs=allocs, frees=frees, unknown_frees=unknown,
                    duplicate_allocs=dups, step_ops=step_ops, empty_cache_ops=empties,
                    trim_ops=trims)


def _fits_int64(t) -> bool:
    try:
        np.asarray([t], dtype=np.int64)
        return True
    except (OverflowError, TypeError, ValueError):
        return False


def _make_pool(conf, backend, limit, options):
    import mempool

    if backend not in BACKENDS:
        raise ValueError(f"replay: backend must be one of {BACKENDS}; got {backend!r}")
    opts = dict(options)
    if limit is not None:
        opts["limit"] = limit
    if conf is None or conf == "":
        return mempool.Pool(backend=backend, **opts)
    if isinstance(conf, str):
        return mempool.Pool.from_conf(conf, backend=backend, **opts)
    if isinstance(conf, dict):
        merged = dict(conf)
        merged.update(opts)
        merged["backend"] = backend   # the argument wins, as over a conf string's key
        return mempool.Pool(**merged)
    raise ValueError(f"replay: conf must be None, a 'key:value,...' string or a dict of "
                     f"options; got {type(conf).__name__}")


def _device_streams(prep: Prepared, backend: str):
    """Stream handles to pass to the pool, by dense index, and what keeps them alive."""
    if backend != "cuda":
        # Simulated and host streams are plain handles: small ints, 0 the default stream.
        return list(range(len(prep.streams))), None
    import cupy

    keep = [cupy.cuda.Stream(non_blocking=True) for _ in prep.streams[1:]]
    return [0] + [s.ptr for s in keep], keep


def _run(pool, ops, handles, ptrs, oom_error, ooms, start=0, empties=(), trims=()):
    """The replay loop, the one every replay runs: `ops` are the events from index `start` on.

    One tuple unpack and one Pool call per event (this is the hot path). A refused allocation
    is recorded in `ooms` as (event index, message) and the replay goes on without it; its
    free is skipped. `empties` are the op indices before which the program emptied the cache
    (Prepared.empty_cache_ops), `trims` the (op index, keep) where it trimmed it
    (Prepared.trim_ops); those in this stretch call the pool's ``empty_cache()`` or
    ``trim(keep)`` between the ops, outside the hot loop.
    """
    if empties or trims:
        for at, keep in _cache_calls(empties, trims, start, start + len(ops)):
            _run_ops(pool, ops[:at - start], handles, ptrs, oom_error, ooms, start)
            _cache_call(pool, keep)
            ops, start = ops[at - start:], at
    _run_ops(pool, ops, handles, ptrs, oom_error, ooms, start)


def _cache_call(pool, keep) -> None:
    """One of the program's cache calls (:func:`_cache_calls`): empty_cache() for keep None,
    else trim(keep)."""
    if keep is None:
        pool.empty_cache()
    else:
        pool.trim(keep)


def _cache_calls(empties, trims, start, end) -> list:
    """The program's calls before the ops in [start, end), in order: ``(op index, keep)``,
    keep None for an empty_cache. At one op index the trims come first: prepare() keeps only
    those the trace has before the empty_cache call there."""
    in_range = empties[bisect.bisect_left(empties, start):bisect.bisect_left(empties, end)]
    # (start,) sorts before every (start, keep): the first trim at or after start.
    trims = trims[bisect.bisect_left(trims, (start,)):bisect.bisect_left(trims, (end,))]
    # sorted() is stable: within one op index the trims keep their trace order.
    return sorted(list(trims) + [(at, None) for at in in_range],
                  key=lambda call: (call[0], call[1] is None))


def stretches(prep: Prepared) -> list:
    """The ops' index ranges ``(start, stop)`` between the program's calls that gave back its
    whole cache (:func:`emptying_ops`): a replay loop that is not :func:`_run` empties its
    allocator's cache before every stretch but the first, and keeps its own hot loop free of
    the check."""
    cuts = [0] + emptying_ops(prep) + [len(prep.ops)]
    return list(zip(cuts, cuts[1:]))


def emptying_ops(prep: Prepared) -> list:
    """The op indices, sorted, before which the program gave back every cached byte: its
    empty_cache calls and its trims to 0. An allocator with no trim to N bytes (PyTorch's,
    CuPy's) replays these as its own empty_cache; the trims it cannot replay are
    :func:`partial_trims`."""
    return sorted(set(prep.empty_cache_ops).union(at for at, keep in prep.trim_ops if not keep))


def partial_trims(prep: Prepared) -> int:
    """The trims that keep some cached bytes (keep > 0): an allocator with no trim to N bytes
    cannot replay them, and a replay through one skips them and says how many."""
    return sum(1 for _, keep in prep.trim_ops if keep)


def _run_ops(pool, ops, handles, ptrs, oom_error, ooms, start):
    alloc = pool.alloc
    free = pool.free
    for i, (slot, nbytes, s) in enumerate(ops, start):
        if nbytes:
            try:
                ptrs[slot] = alloc(nbytes, handles[s])
            except oom_error as e:
                ptrs[slot] = 0
                ooms.append((i, str(e)))
        else:
            p = ptrs[slot]
            if p:
                ptrs[slot] = 0
                free(p, None if s is None else handles[s])


def _upstream(stats: dict) -> dict:
    return {k: _stat(stats, key) for k, key in UPSTREAM_COUNTERS.items()}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _stepped_run(pool, prep, handles, ptrs, oom_error, ooms, between=None):
    """_run one step at a time: [counters at the start, then at each step's start], and the
    ns spent reading them (and calling `between()` at each step's start, when given)."""
    ops = prep.ops
    bounds = [0] + list(prep.step_ops) + [len(ops)]
    counts = []
    spent = 0
    for i in range(len(bounds) - 1):
        t = time.perf_counter_ns()
        if between is not None:
            between()
        counts.append(_upstream(pool.stats()))
        spent += time.perf_counter_ns() - t
        _run(pool, ops[bounds[i]:bounds[i + 1]], handles, ptrs, oom_error, ooms, bounds[i],
             prep.empty_cache_ops, prep.trim_ops)
    return counts, spent


def _device_sync(pool):
    """A function synchronizing the pool's device."""
    import cupy

    device = cupy.cuda.Device(pool.device_id)
    return device.synchronize


def _stat(stats: dict, key: str, default=0) -> int:
    value = stats.get(key, default)
    return int(value) if value is not None else default


def replay(events, conf=None, backend: str = "sim", limit=None, timeseries: bool = False,
           check: bool = False, sync_steps: bool = False, sim_delays_ns=None,
           **options) -> ReplayResult:
    """Replay a trace through a fresh Pool and measure it.

    Parameters
    ----------
    events : Trace, iterable of Event, Prepared, or a path
        The trace (see :mod:`mempool.tools.trace`), or a file of one in any format
        :func:`mempool.tools.trace.load_any` reads; :func:`prepare` it once to replay it often.
    conf : str or dict, optional
        The pool's options: a ``"key:value,..."`` string as ``MEMPOOL_CONF`` takes, or a dict
        of ``Pool`` keywords. None = the defaults.
    backend : {"sim", "host", "cuda"}
        ``"sim"`` replays at GPU scale on the simulated device; ``"cuda"`` allocates real
        device memory (no kernels run); ``"host"`` allocates host memory.
    limit : int, str or float, optional
        The pool's ``limit`` (a cap on reserved bytes), e.g. to replay a trace as if on a
        smaller GPU. Allocations it refuses are counted in ``num_ooms``; the replay goes on.
    timeseries : bool
        Also record live and reserved bytes over the replay (about 2,000 points; each the
        highest value in its stretch of events) in ``result.timeseries``: a dict of numpy
        arrays ``event`` (index of the last event of each stretch), ``time_ns``,
        ``live_bytes``, ``reserved_bytes``.
    check : bool
        Call ``pool.check_invariants()`` at the end of the replay.
    sync_steps : bool
        On cuda, synchronize the device at the start of every step of a trace that marks
        its steps (outside the timing; not with `timeseries`), as a training loop that reads
        its loss each step does; the cudaMemPool under the default path releases what the pool gave back at a
        synchronization (Note [The driver keeps nothing given back], mempool/_cuda.py).
    sim_delays_ns : (int, int), optional
        On sim, every page map and unmap takes this many nanoseconds (map, unmap), as a
        driver's does (``SimDevice.set_call_delays``), so that ``ns_per_event`` shows where
        that time falls (on the replaying thread, or on the mapper's with ``map_ahead``).
    **options
        Further ``Pool`` keywords (``capacity``, ``device``, any option); they override
        `conf`.

    Returns
    -------
    ReplayResult
        Deterministic on sim except ``ns_per_event``.
    """
    if sim_delays_ns is not None:
        if backend != "sim":
            raise ValueError(f"replay: sim_delays_ns models the driver on backend 'sim' only, "
                             f"not {backend!r}")
        if not isinstance(sim_delays_ns, (tuple, list)) or len(sim_delays_ns) != 2:
            raise ValueError(f"replay: sim_delays_ns is (map_ns, unmap_ns), two ints of "
                             f"nanoseconds; got {sim_delays_ns!r}")
    prep = prepare(events)
    pool = _make_pool(conf, backend, limit, options)
    if sim_delays_ns is not None:
        pool.device.set_call_delays(*sim_delays_ns)
    import mempool

    oom_error = mempool.OutOfMemoryError
    handles, keep_streams = _device_streams(prep, backend)
    ops = prep.ops
    ptrs = [0] * prep.nslots
    ooms = []
    series = None
    t0 = time.perf_counter_ns()
    counts = None
    between = _device_sync(pool) if sync_steps and backend == "cuda" else None
    if not timeseries:
        if prep.step_ops:
            # Step by step, the upstream counters read between steps, outside the timing.
            counts, spent = _stepped_run(pool, prep, handles, ptrs, oom_error, ooms, between)
            t0 += spent
        else:
            _run(pool, ops, handles, ptrs, oom_error, ooms, 0, prep.empty_cache_ops,
                 prep.trim_ops)
        peak_reserved = peak_allocated = None
    else:
        n = len(ops)
        stride = max(1, -(-n // TIMESERIES_POINTS))
        ends, reserved = [], []
        peak_allocated = 0
        for start in range(0, n, stride):
            stop = min(n, start + stride)
            # Peaks are reset per stretch, to plot each stretch's highest point.
            pool.reset_peak_stats()
            _run(pool, ops[start:stop], handles, ptrs, oom_error, ooms, start,
                 prep.empty_cache_ops, prep.trim_ops)
            st = pool.stats()
            reserved.append(_stat(st, "reserved_bytes.all.peak"))
            peak_allocated = max(peak_allocated, _stat(st, "allocated_bytes.all.peak"))
            ends.append(stop - 1)
        series = (np.asarray(ends, dtype=np.int64), np.asarray(reserved, dtype=np.int64))
        peak_reserved = int(series[1].max(initial=0))
    elapsed = time.perf_counter_ns() - t0
    pool._mapper_wait_idle()   # Note [Mapper]: its counts settled, outside the timing

    stats = dict(pool.stats())
    total = _upstream(stats)
    setup = steps = None
    if counts is not None:
        marks = counts + [total]
        setup = _delta(marks[1], marks[0])
        steps = [_delta(marks[i + 1], marks[i]) for i in range(1, len(marks) - 1)]
    if peak_reserved is None:
        peak_reserved = _stat(stats, "reserved_bytes.all.peak")
        peak_allocated = _stat(stats, "allocated_bytes.all.peak")
    options_used = dict(getattr(pool, "options", {}) or {})
    if check:
        pool.check_invariants()
    _release(pool, ptrs, keep_streams)

    deltas = prep.deltas
    if ooms:
        # Refused allocations held nothing, and their frees were skipped.
        deltas = deltas.copy()
        idx = np.fromiter((i for i, _ in ooms), dtype=np.int64, count=len(ooms))
        deltas[idx] = 0
        freed = prep.partner[idx]
        deltas[freed[freed >= 0]] = 0
    live = np.cumsum(deltas)
    peak_live = int(live.max(initial=0))
    if series is not None:
        ends, reserved = series
        starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else ends
        live_max = np.maximum.reduceat(live, starts) if len(live) else live
        series = {"event": ends, "time_ns": prep.times_ns[ends] if len(ends) else ends,
                  "live_bytes": live_max, "reserved_bytes": reserved}
    return ReplayResult(
        backend=backend, options=options_used, events=prep.events, allocs=prep.allocs,
        frees=prep.frees, peak_live_bytes=peak_live, peak_reserved_bytes=peak_reserved,
        peak_allocated_bytes=peak_allocated, num_ooms=len(ooms),
        unknown_frees=prep.unknown_frees, duplicate_allocs=prep.duplicate_allocs,
        num_device_alloc=_stat(stats, "num_device_alloc"),
        num_device_free=_stat(stats, "num_device_free"),
        ns_per_event=elapsed / max(1, len(ops)), first_oom=ooms[0][1] if ooms else None,
        empty_cache_calls=len(prep.empty_cache_ops), trim_calls=len(prep.trim_ops),
        timeseries=series, stats=stats, upstream=total, setup=setup, steps=steps,
        driver_reserved_peak_bytes=_driver_peak(backend, options_used, stats))


def _driver_peak(backend: str, options: dict, stats: dict) -> int | None:
    """The cudaMemPool's reserved high watermark where segments come from it."""
    if backend != "cuda" or options.get("expandable_segments"):
        return None
    value = stats.get("cuda_pool.reserved_high")
    return None if value is None else int(value)


def _release(pool, ptrs, keep_streams) -> None:
    """Free what the trace left live, so the pool ends empty (and real memory returns)."""
    for p in ptrs:
        if p:
            pool.free(p)
    ptrs[:] = [0] * len(ptrs)
    if keep_streams:
        for s in keep_streams:
            s.synchronize()
    empty = getattr(pool, "empty_cache", None)
    if empty is not None:
        empty()


def _to_peak_reserved(prep: Prepared, conf, backend: str, limit, options) -> tuple:
    """(pool, live pointers, op index, that allocation's pointer): the replay stopped just
    after the allocation that takes reserved bytes to their peak (None for the index, and 0
    for the pointer, where none does)."""
    import mempool

    target = replay(prep, conf=conf, backend=backend, limit=limit,
                    **options).peak_reserved_bytes
    handles, _ = _device_streams(prep, backend)
    ops = prep.ops
    ptrs = [0] * prep.nslots
    pool = _make_pool(conf, backend, limit, options)
    reserved = pool.reserved_bytes
    for i in range(len(ops)):
        _run(pool, ops[i:i + 1], handles, ptrs, mempool.OutOfMemoryError, [], i,
             prep.empty_cache_ops, prep.trim_ops)
        if ops[i][1] and reserved() >= target:
            return pool, [p for p in ptrs if p], i, ptrs[ops[i][0]]
    return pool, [p for p in ptrs if p], None, 0


def peak_excess(events, conf=None, backend: str = "sim", limit=None, **options) -> dict:
    """Where the bytes the pool holds beyond the live ones lie at the moment reserved bytes
    reach their peak, just after the request that took them there, and what that request
    found free just before it.

    Returns a dict: ``request_bytes`` (that request; 0 where nothing was reserved) and at the
    peak ``reserved_bytes``, ``live_bytes`` (the requested sizes of the blocks then live),
    ``rounding_bytes`` (what the pool's rounding added to them), ``free_bytes`` in
    ``free_blocks`` cached blocks, the largest of them ``largest_free_bytes``, and
    ``segments``; then ``request_kind`` (the segments it went to: "small" or "large") and,
    just before it, the bytes free in segments of that kind on its stream, where it was
    looked for (``free_before_its_kind``, the largest ``largest_free_before_its_kind``).
    backend is 'sim' or 'host', as for :func:`pool_at`."""
    if backend == "cuda":
        raise ValueError("peak_excess: backend must be 'sim' or 'host' (the pool is read "
                         "part way through the replay)")
    prep = prepare(events)

    def read(pool, ptrs):
        try:
            return pool.snapshot()["segments"]
        finally:
            for p in ptrs:
                pool.free(p)

    def free_in(segments):
        return [b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "inactive"]

    pool, ptrs, at, ptr = _to_peak_reserved(prep, conf, backend, limit, options)
    segments = read(pool, ptrs)
    mine = next((seg for seg in segments
                 if ptr and seg["address"] <= ptr < seg["address"] + seg["total_size"]), None)
    kin = []
    if mine is not None:
        # Before it: the ops ahead of it, then the program's cache calls just before it.
        pool, ptrs = pool_at(prep, at, conf, backend, limit, **options)
        for _, keep in _cache_calls(prep.empty_cache_ops, prep.trim_ops, at, at + 1):
            _cache_call(pool, keep)
        before = read(pool, ptrs)
        kin = free_in([seg for seg in before if (seg["segment_type"], seg["stream"]) ==
                       (mine["segment_type"], mine["stream"])])
    free = free_in(segments)
    allocated = sum(seg["allocated_size"] for seg in segments)
    live = sum(seg["requested_size"] for seg in segments)
    return {"request_bytes": int(prep.ops[at][1]) if at is not None else 0,
            "reserved_bytes": sum(seg["total_size"] for seg in segments),
            "live_bytes": live, "rounding_bytes": allocated - live,
            "free_bytes": sum(free), "free_blocks": len(free),
            "largest_free_bytes": max(free, default=0), "segments": len(segments),
            "request_kind": mine["segment_type"] if mine else None,
            "free_before_its_kind": sum(kin), "largest_free_before_its_kind": max(kin, default=0)}


def pool_at(events, stop="peak_reserved", conf=None, backend: str = "sim", limit=None,
            **options):
    """The pool as it stands part way through a replay, for a snapshot or a segment map.

    Parameters
    ----------
    stop : int, "peak_reserved" or "peak_live"
        Replay this many events (ops); or stop just after the allocation that takes
        reserved bytes to their peak (the moment fragmentation costs most: the cached blocks
        could not serve it), or the first moment live bytes peak.

    Returns
    -------
    (Pool, list of int)
        The pool and the pointers still live in it; free them (or drop the pool) when done.
        OOMs are skipped as in :func:`replay`.
    """
    prep = prepare(events)
    if backend == "cuda":
        raise ValueError("pool_at: backend must be 'sim' or 'host' (the pool is handed back "
                         "live, and a cuda replay's streams would not outlive this call)")
    if isinstance(stop, str) and stop == "peak_reserved":
        pool, ptrs, _, _ = _to_peak_reserved(prep, conf, backend, limit, options)
        return pool, ptrs
    import mempool

    oom_error = mempool.OutOfMemoryError
    handles, _ = _device_streams(prep, backend)
    ops = prep.ops
    ptrs = [0] * prep.nslots
    if isinstance(stop, str) and stop == "peak_live":
        live = np.cumsum(prep.deltas)
        stop = int(live.argmax()) + 1 if len(live) else 0
    if isinstance(stop, bool) or not isinstance(stop, int) or not 0 <= stop <= len(ops):
        raise ValueError(f"pool_at: stop must be an int in [0, {len(ops)}], 'peak_reserved' "
                         f"or 'peak_live'; got {stop!r}")
    pool = _make_pool(conf, backend, limit, options)
    _run(pool, ops[:stop], handles, ptrs, oom_error, [], 0, prep.empty_cache_ops,
         prep.trim_ops)
    return pool, [p for p in ptrs if p]
