"""Observability output in PyTorch's formats, so PyTorch's tools read it unchanged.

- :func:`summary`: the text table of ``torch.cuda.memory_summary()``, from a flat stats dict
  with ``torch.cuda.memory_stats()`` key names;
- :func:`snapshot`: the dict of ``torch.cuda.memory._snapshot()``, which
  ``torch.cuda._memory_viz`` (``segment_plot``, ``trace_plot``, ``segments``, ``memory``,
  ``segsum``, ``trace``) and pytorch.org/memory_viz render.

Python over the Pool's output: the Pool gathers the numbers from the core and hands them
over; the codes (trace actions, block states) are the extension's.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from mempool import _core
from mempool._core import BLOCK_ALLOCATED, BLOCK_FREE, BLOCK_PENDING, BLOCK_UNMAPPED
from mempool._units import PREFIXES

__all__ = ["summary", "snapshot", "BLOCK_STATES", "TRACE_ACTIONS"]

# The core's block states (mp_core.h MP_BLOCK_*, through the extension) and PyTorch's names
# for them. Unmapped pages of an expandable segment have no PyTorch name: they are left out of
# the snapshot.
BLOCK_STATES = {
    BLOCK_FREE: "inactive",
    BLOCK_ALLOCATED: "active_allocated",
    BLOCK_PENDING: "active_pending_free",   # freed, waiting on events of other streams
}

# The core's trace actions by code (mp_core.h MP_TRACE_*), named in the extension as PyTorch's
# TraceEntry names them.
TRACE_ACTIONS = dict(enumerate(_core.TRACE_ACTIONS))
TRACE_OOM = _core.TRACE_ACTIONS.index("oom")
_ACTION_CODES = {name: code for code, name in TRACE_ACTIONS.items()}
TRACE_EMPTY_CACHE = _ACTION_CODES["empty_cache"]
TRACE_TRIM = _ACTION_CODES["trim"]
# The program's calls for cached memory back: PyTorch's trace has no entry for them.
_NO_TORCH_ENTRY = (TRACE_EMPTY_CACHE, TRACE_TRIM)

# --------------------------------------------------------------------------- summary

_WIDTH = 75

# (key family, row label, is a byte count): the rows of torch.cuda.memory_summary().
_POOL_METRICS = (
    ("allocated_bytes", "Allocated memory", True),
    ("active_bytes", "Active memory", True),
    ("requested_bytes", "Requested memory", True),
    ("reserved_bytes", "GPU reserved memory", True),
    ("inactive_split_bytes", "Non-releasable memory", True),
    ("allocation", "Allocations", False),
    ("active", "Active allocs", False),
    ("segment", "GPU reserved segments", False),
    ("inactive_split", "Non-releasable allocs", False),
)
_OVERSIZE_METRICS = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
)
_COLUMNS = ("current", "peak", "allocated", "freed")


def _format_size(nbytes: int, pref: float) -> str:
    # PyTorch's rule: the unit is chosen by the row's "all" value (pref) so the sub-rows of
    # one metric share a unit; a unit is taken while pref >= 768 of the next one down.
    prefix = "B  "
    for new_prefix in PREFIXES:
        if pref < 768 * 1024:
            break
        prefix = new_prefix
        nbytes //= 1024
        pref /= 1024
    return f"{nbytes:6d} {prefix}"


def _format_count(count: int, pref: float) -> str:
    prefix = " "
    for new_prefix in ("K", "M"):
        if pref < 750 * 1000:
            break
        prefix = new_prefix
        count //= 1000
        pref /= 1000
    return f"{count:7d} {prefix} "


def _required_keys(abbreviated: bool) -> list[str]:
    pools = ("all",) if abbreviated else ("all", "large_pool", "small_pool")
    keys = [f"{family}.{pool}.{col}" for family, _, _ in _POOL_METRICS
            for pool in pools for col in _COLUMNS]
    keys += [f"{family}.{col}" for family, _ in _OVERSIZE_METRICS for col in _COLUMNS]
    return keys + ["num_ooms", "num_alloc_retries"]


def summary(stats: Mapping[str, int], device: int = 0, abbreviated: bool = False,
            backend: str = "cuda") -> str:
    """Format pool statistics as ``torch.cuda.memory_summary()`` does.

    Parameters
    ----------
    stats : mapping
        Flat statistics with ``torch.cuda.memory_stats()`` key names:
        ``"allocated_bytes.all.current"``, ``"reserved_bytes.large_pool.peak"``,
        ``"oversize_allocations.freed"``, ``"num_ooms"``, ``"num_alloc_retries"``, ... The
        key families are allocated_bytes, active_bytes, requested_bytes, reserved_bytes,
        inactive_split_bytes, allocation, active, segment, inactive_split (each with
        all/large_pool/small_pool and current/peak/allocated/freed) and
        oversize_allocations, oversize_segments (current/peak/allocated/freed).
    device : int
        Device id shown in the title.
    abbreviated : bool
        Leave out the large-pool / small-pool sub-rows (the ``all`` rows remain).
    backend : str
        The pool's backend. On ``cuda`` the table is PyTorch's to the character; on ``sim``
        and ``host`` the rows PyTorch calls "GPU reserved ..." read "Reserved ..." and the
        title names the backend, since no GPU memory is involved.

    Returns
    -------
    str
        The table: 75 columns between ``|`` borders, one row per metric, columns Cur Usage,
        Peak Usage, Tot Alloc, Tot Freed; the same rows, units and widths as PyTorch's.

    Raises
    ------
    ValueError
        When a key the table needs is missing or not an int.
    """
    missing = [k for k in _required_keys(abbreviated) if k not in stats]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"stats: missing {', '.join(missing[:5])}{more} "
                         "(summary needs torch.cuda.memory_stats() keys)")
    bad = [k for k in _required_keys(abbreviated)
           if isinstance(stats[k], bool) or not isinstance(stats[k], int)]
    if bad:
        raise ValueError(f"stats: {bad[0]!r} is {stats[bad[0]]!r}, not an int")

    lines = [
        "=" * _WIDTH,
        (f" {'':21} mempool memory summary, device ID {device:<17d} " if backend == "cuda"
         else f" {'':21} {f'mempool memory summary, {backend} device {device}':<52}"),
        "-" * _WIDTH,
        f"  {'':9} OOMs: {stats['num_ooms']:<17d} | {'':6} alloc retries: "
        f"{stats['num_alloc_retries']:<13d}  ",
        "=" * _WIDTH,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    for family, label, is_bytes in _POOL_METRICS:
        if backend != "cuda":
            label = label.replace("GPU reserved memory", "Reserved memory").replace(
                "GPU reserved segments", "Reserved segments")
        fmt = _format_size if is_bytes else _format_count
        lines.append("-" * _WIDTH)
        rows = [("all", label)]
        if not abbreviated:
            rows += [("large_pool", "      from large pool"), ("small_pool", "      from small pool")]
        prefs = None
        for pool, name in rows:
            values = [stats[f"{family}.{pool}.{col}"] for col in _COLUMNS]
            if prefs is None:
                prefs = values
            cells = " | ".join(fmt(v, p) for v, p in zip(values, prefs))
            lines.append(f" {name:<21} | {cells} ")
    for family, label in _OVERSIZE_METRICS:
        if backend != "cuda":
            label = label.replace(" GPU", "")
        lines.append("-" * _WIDTH)
        values = [stats[f"{family}.{col}"] for col in _COLUMNS]
        cells = " | ".join(_format_count(v, v) for v in values)
        lines.append(f" {label:<21} | {cells} ")
    lines.append("=" * _WIDTH)
    return "|" + "|\n|".join(lines) + "|\n"


# --------------------------------------------------------------------------- snapshot


def _field(d: Mapping[str, Any], key: str, where: str, default: Any = ...) -> Any:
    if key in d:
        return d[key]
    if default is not ...:
        return default
    raise ValueError(f"{where}: missing {key!r}")


def _segment_runs(seg: Mapping[str, Any], device: int) -> list[dict]:
    address = _field(seg, "address", "segment")
    where = f"segment at {address:#x}"
    total = _field(seg, "total_size", where)
    stream = _field(seg, "stream", where)
    is_small = bool(_field(seg, "is_small", where))
    expandable = bool(_field(seg, "is_expandable", where, False))
    blocks = sorted(_field(seg, "blocks", where), key=lambda b: _field(b, "address", where))

    # The blocks must tile the segment exactly: PyTorch's viewer places each block at the
    # segment's address plus the sizes before it.
    cursor = address
    for b in blocks:
        if b["address"] != cursor:
            raise ValueError(f"{where}: blocks do not tile it: a block starts at "
                             f"{b['address']:#x}, expected {cursor:#x}")
        cursor += _field(b, "size", where)
        state = _field(b, "state", where)
        if state not in BLOCK_STATES and state != BLOCK_UNMAPPED:
            raise ValueError(f"{where}: block at {b['address']:#x} has state {state!r}; "
                             "accepted: 0 free, 1 allocated, 2 pending free, 3 unmapped")
        if state == BLOCK_UNMAPPED and not expandable:
            raise ValueError(f"{where}: block at {b['address']:#x} is unmapped, but the "
                             "segment is not expandable")
    if cursor != address + total:
        raise ValueError(f"{where}: its blocks cover {cursor - address} bytes, its "
                         f"total_size is {total}")
    mapped = sum(b["size"] for b in blocks if b["state"] != BLOCK_UNMAPPED)
    if _field(seg, "mapped_size", where, mapped) != mapped:
        raise ValueError(f"{where}: mapped_size is {seg['mapped_size']}, its mapped blocks "
                         f"cover {mapped} bytes")

    # As PyTorch does, an expandable segment shows as one segment per contiguous mapped run;
    # va_address / va_size / mapped_size describe the whole address-space reservation.
    runs: list[list[Mapping[str, Any]]] = []
    current: list[Mapping[str, Any]] = []
    for b in blocks:
        if b["state"] == BLOCK_UNMAPPED:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(b)
    if current:
        runs.append(current)

    out = []
    for run in runs:
        torch_blocks = []
        allocated = active = requested = 0
        for b in run:
            state = BLOCK_STATES[b["state"]]
            req = int(_field(b, "requested_size", where, 0))
            # As PyTorch's snapshot: a free block shows the size last requested of it.
            shown = int(b.get("last_requested_size", req)) if state == "inactive" else req
            torch_blocks.append({"address": b["address"], "size": b["size"],
                                 "requested_size": shown, "state": state, "frames": []})
            if b["state"] == BLOCK_ALLOCATED:
                allocated += b["size"]
            if b["state"] in (BLOCK_ALLOCATED, BLOCK_PENDING):
                active += b["size"]
                requested += req
        entry = {
            "device": device,
            "address": run[0]["address"],
            "total_size": sum(b["size"] for b in run),
            "allocated_size": allocated,
            "active_size": active,
            "requested_size": requested,
            "stream": stream,
            "segment_type": "small" if is_small else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": expandable,
            "frames": [],
            "blocks": torch_blocks,
        }
        if expandable:
            entry.update(va_address=address, va_size=total, mapped_size=mapped)
        out.append(entry)
    return out


def _trace_entry(t: Sequence[int]) -> dict | None:
    """PyTorch's form of one recorded entry; None for an empty_cache or trim call, which has
    no PyTorch action (what it released follows it in the trace)."""
    if len(t) != 5:
        raise ValueError(f"trace entry {t!r}: expected (action, ptr, nbytes, stream, time_ns)")
    action, ptr, nbytes, stream, time_ns = t
    # Pool.history() gives the action's name, the core its code: accept either.
    if isinstance(action, str) and action in _ACTION_CODES:
        action = _ACTION_CODES[action]
    if isinstance(action, bool) or action not in TRACE_ACTIONS:
        raise ValueError(f"trace entry {t!r}: unknown action {action!r}; accepted: "
                         + ", ".join(f"{k} {v}" for k, v in TRACE_ACTIONS.items())
                         + " (the code or the name)")
    if action in _NO_TORCH_ENTRY:
        return None
    entry = {"action": TRACE_ACTIONS[action]}
    # PyTorch's OOM entries carry the device's free bytes where others carry an address.
    entry["device_free" if action == TRACE_OOM else "addr"] = ptr
    entry.update(size=nbytes, stream=stream, time_us=time_ns // 1000, frames=[])
    return entry


def snapshot(segments: Iterable[Mapping[str, Any]],
             traces: Iterable[Sequence[int]] | None = None,
             device: int = 0) -> dict:
    """Build a ``torch.cuda.memory._snapshot()`` dict from the pool's layout and trace.

    Parameters
    ----------
    segments : iterable of dict
        One dict per segment: ``address``, ``total_size`` (reserved bytes; address space
        for an expandable segment), ``mapped_size`` (optional; checked when given),
        ``stream``, ``is_small``, ``is_expandable`` and ``blocks``, a list of dicts
        ``{address, size, requested_size, stream, state}`` (and ``last_requested_size``,
        which a free block shows as its ``requested_size``, as PyTorch's does) that tile the
        segment, with ``state`` 0 free, 1 allocated, 2 pending free (waiting on other
        streams' events), 3 unmapped (expandable segments only).
    traces : iterable of tuple, optional
        Recorded events, oldest first, each ``(action, ptr, nbytes, stream, time_ns)``
        as :meth:`mempool.Pool.history` gives them, with ``action`` a name or its code
        (:data:`TRACE_ACTIONS`, code to name). For an oom, ``ptr`` holds the bytes the device
        had free, as in PyTorch's trace. ``empty_cache`` and ``trim`` entries are left out:
        PyTorch's trace has no such action.
    device : int
        The device id: the segments' ``device`` and the index of the trace in
        ``device_traces``.

    Returns
    -------
    dict
        ``{"segments": [...], "device_traces": [[...], ...]}`` as PyTorch makes it:
        segments sorted by address, with ``device``, ``address``, ``total_size``,
        ``allocated_size``, ``active_size``, ``requested_size``, ``stream``,
        ``segment_type`` ("small"/"large"), ``segment_pool_id``, ``is_expandable``,
        ``frames`` and ``blocks`` (``address``, ``size``, ``requested_size``, ``state``
        "active_allocated"/"active_pending_free"/"inactive", ``frames``). An expandable
        segment appears as one segment per contiguous mapped run (unmapped pages are left
        out), each also carrying ``va_address``, ``va_size`` and ``mapped_size`` of its
        reservation. ``device_traces`` has one list per device up to ``device``; trace
        entries have ``action``, ``addr`` (``device_free`` for oom), ``size``, ``stream``,
        ``time_us`` and ``frames``.

    Raises
    ------
    ValueError
        When blocks do not tile their segment, a state or action is unknown, or a field
        is missing.
    """
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device: {device!r} is not valid; accepted: an int >= 0")
    out_segments = []
    for seg in segments:
        out_segments.extend(_segment_runs(seg, device))
    out_segments.sort(key=lambda s: s["address"])
    entries = [e for e in map(_trace_entry, traces or ()) if e is not None]
    device_traces: list[list[dict]] = [[] for _ in range(device)] + [entries]
    return {"segments": out_segments, "device_traces": device_traces}
