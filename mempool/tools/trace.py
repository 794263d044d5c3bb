"""Allocation traces: record, save, load and import.

A trace is a sequence of :class:`Event` s, each an allocation or a free of one buffer:
``Event(action, id, nbytes, stream, time_ns)`` with ``action`` ``"alloc"`` or ``"free"``.
``id`` names the buffer (a small integer, or the address it had when it was recorded); a free
refers to the id of an earlier alloc. ``nbytes`` is the requested size, ``stream`` the stream
the event happened on (0 = the default stream) and ``time_ns`` when it happened, in
nanoseconds from an arbitrary origin. A third action, ``"empty_cache"`` (``id`` and
``nbytes`` 0), is the program asking for the allocator's cached memory back
(``torch.cuda.empty_cache()``, which PyTorch's cuDNN benchmark also calls after each
algorithm search): a replay empties the pool's cache there, as the program did. A fourth,
``"trim"`` (``id`` 0, ``nbytes`` the ``keep`` argument, 0 allowed), is the program's
``Pool.trim(keep)``: a replay trims the pool's cache to ``keep`` bytes there.

File format (``save`` / ``load``): JSON lines, UTF-8, optionally gzip-compressed. The first
line is a header object::

    {"format": "mempool-trace", "version": 1, "events": 22104, "fields": [...], ...}

and each further line one event as a JSON array ``["alloc", 17, 4194304, 0, 1234567]``
(arrays, not objects, to keep files small). ``"events"`` in the header is the number of event
lines, so a truncated file is detected. Other header keys are free-form metadata (``source``,
``description``, ...), returned as :attr:`Trace.meta`.

Importers turn other tools' records into the same events: :func:`from_pool_history` (this
pool's own recording), :func:`from_torch_snapshot` (``torch.cuda.memory._snapshot()``) and
:func:`from_rmm_csv` (RMM's ``logging_resource_adaptor``).
"""
from __future__ import annotations

import csv
import functools
import gzip
import io
import itertools
import json
import operator
import os
import pickle
import re
from typing import Iterable, NamedTuple

from mempool import _core
from mempool.tools import _read

__all__ = [
    "Event", "Trace", "FORMAT", "VERSION", "save", "load", "load_any", "from_pool_history",
    "from_torch_snapshot", "from_rmm_csv", "save_trace",
]

FORMAT = "mempool-trace"
VERSION = 1
FIELDS = ["action", "id", "nbytes", "stream", "time_ns"]
ACTIONS = ("alloc", "free", "empty_cache", "trim")
_BUFFER_ACTIONS = ("alloc", "free")    # load's fast path; the cache calls take the checked one
_ACTIONS_TEXT = "'alloc', 'free', 'empty_cache' or 'trim'"   # what an error message accepts

# The pool's recorded entry actions (the extension's TRACE_ACTIONS), by code or by name, that
# become events; only allocs, free requests, empty_cache and trim calls are replayable: the
# others are the pool's own reactions (segments, completions, OOMs) to them.
_HISTORY_ACTIONS = {}
for _name, _kind in (("alloc", "alloc"), ("free_requested", "free"),
                     ("empty_cache", "empty_cache"), ("trim", "trim")):
    _HISTORY_ACTIONS[_core.TRACE_ACTIONS.index(_name)] = _HISTORY_ACTIONS[_name] = _kind
del _name, _kind


class Event(NamedTuple):
    """One allocation or free in a trace, or one call for cached memory back."""

    action: str     #: "alloc", "free", "empty_cache" or "trim"
    id: int         #: names the buffer; a free names an earlier alloc's id (else 0)
    nbytes: int     #: requested bytes (0 when a free's size is unknown; empty_cache: 0;
                    #: trim: its ``keep``)
    stream: int     #: stream handle the event ran on; 0 = the default stream
    time_ns: int    #: when, in ns from an arbitrary origin


class Trace(list):
    """A list of :class:`Event` s with the file's header metadata in :attr:`meta`."""

    def __init__(self, events: Iterable = (), meta: dict | None = None):
        super().__init__(events)
        self.meta = dict(meta or {})

    def __repr__(self) -> str:
        source = self.meta.get("source", "?")
        return f"<Trace {len(self)} events, source={source!r}>"


# ----------------------------------------------------------------------------------------
# save / load


def _check_event(ev, where: str) -> Event:
    """Validate one event (a tuple or Event); `where` prefixes the message."""
    if isinstance(ev, Event):
        action, ident, nbytes, stream, time_ns = ev
    else:
        if not isinstance(ev, (list, tuple)) or len(ev) != 5:
            raise ValueError(f"{where}: an event must be [action, id, nbytes, stream, time_ns]"
                             f" (5 fields); got {ev!r:.200}")
        action, ident, nbytes, stream, time_ns = ev
    if action not in ACTIONS:
        raise ValueError(f"{where}: action must be {_ACTIONS_TEXT}; got {action!r:.80}")
    if isinstance(ident, bool) or not isinstance(ident, (int, str)):
        raise ValueError(f"{where}: id must be an int or a str; got {ident!r:.80}")
    if action == "trim":
        _check_trim(ident, nbytes, where)
    for name, value in (("nbytes", nbytes), ("stream", stream), ("time_ns", time_ns)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be an int >= 0; got {value!r:.80}")
    if action == "alloc" and nbytes == 0:
        raise ValueError(f"{where}: an alloc needs nbytes > 0; got 0")
    if action == "empty_cache" and (ident != 0 or nbytes != 0):
        raise ValueError(f"{where}: an empty_cache event names no buffer: its id and nbytes "
                         f"are 0; got id {ident!r}, nbytes {nbytes!r}")
    return Event(action, ident, nbytes, stream, time_ns)


def _check_trim(ident, nbytes, where: str) -> int:
    """A trim event names no buffer, and its nbytes is trim's ``keep``: 0 is a trim to
    nothing cached, not an empty size as an alloc's 0 would be. Returns the keep (an int
    of any integer type; saving and loading still take only ints). Replays check their
    trims with it too (mempool/tools/replay.py)."""
    if ident != 0:
        raise ValueError(f"{where}: a trim event names no buffer: its id is 0; got id "
                         f"{ident!r}")
    try:
        keep = operator.index(nbytes)
    except TypeError:
        keep = -1
    # Below 2**63, as every size a replay sums: a larger keep is no pool's cache.
    if isinstance(nbytes, bool) or not 0 <= keep < 1 << 63:
        raise ValueError(f"{where}: a trim event's nbytes is trim's keep, an int in "
                         f"[0, 2**63) (0 accepted); got {nbytes!r:.40}")
    return keep


def save(events: Iterable, path, meta: dict | None = None) -> int:
    """Write events to `path` as a mempool trace; gzip-compressed when it ends in ``.gz``.

    Parameters
    ----------
    events : iterable of Event or 5-tuples
        ``(action, id, nbytes, stream, time_ns)``; validated before anything is written.
    path : str or os.PathLike
        Destination. The write is atomic: a temporary file is renamed over `path`.
    meta : dict, optional
        Extra header keys (JSON-serialisable); a :class:`Trace` 's own ``meta`` is used when
        not given. ``format``, ``version``, ``events`` and ``fields`` are reserved.

    Returns
    -------
    int
        The number of events written.
    """
    path = os.fspath(path)
    checked = [_check_event(ev, f"save: event {i}") for i, ev in enumerate(events)]
    if meta is None:
        meta = getattr(events, "meta", {}) or {}
    reserved = {"format", "version", "events", "fields"} & set(meta)
    if reserved:
        raise ValueError(f"save: meta may not set {sorted(reserved)}; those keys are written "
                         "by save itself")
    header = {"format": FORMAT, "version": VERSION, "events": len(checked), "fields": FIELDS}
    header.update(meta)
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    lines = [dumps(header)]
    lines += [dumps(list(ev)) for ev in checked]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    if path.endswith(".gz"):
        # mtime=0 keeps the bytes reproducible: the same events give the same file.
        data = gzip.compress(data, compresslevel=9, mtime=0)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(checked)


# Bounds on every file a reader takes, so that a hostile or damaged one (a gzip bomb, a line
# of megabytes) is a clear ValueError rather than memory exhausted. Module constants: a
# program reading larger traces raises them (``mempool.tools.trace.MAX_INPUT_BYTES = ...``).
MAX_INPUT_BYTES = 2 << 30       # the most bytes a file may hold, after decompression
MAX_LINE_BYTES = 1 << 20        # the longest line (a header with its metadata included)
MAX_NESTING = 64                # the deepest a header's or an entry's values may nest


def _chunks(path: str):
    return _read.chunks(path, MAX_INPUT_BYTES)


def _lines(path: str):
    return _read.lines(path, MAX_INPUT_BYTES, MAX_LINE_BYTES)


def _json(text: str):
    return _read.json_value(text, MAX_NESTING)


def _depth_ok(value) -> bool:
    return _read.depth_ok(value, MAX_NESTING)


_open_checked = _read.open_checked


def _deep(reader):
    """`reader`, with data nested beyond the interpreter's stack a ValueError (the reader's
    own checks go through it recursively, as its messages' reprs do)."""
    @functools.wraps(reader)
    def read(path_or_data, *args, **kwargs):
        try:
            return reader(path_or_data, *args, **kwargs)
        except RecursionError:
            where = "<dict>" if isinstance(path_or_data, dict) else os.fspath(path_or_data)
            raise ValueError(f"{where}: values nested too deeply to be a trace or snapshot"
                             ) from None
    return read


def check_step_starts(value, where: str) -> list:
    """A trace's ``meta["step_starts"]``: the indices of the events that begin training
    steps, a list of ints >= 0 (or None)."""
    if value is None:
        return None
    if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ValueError(f"{where}: 'step_starts' must be a list of event indices (ints "
                         f">= 0); got {value!r:.80}")
    return value


def _rows(lines, path: str) -> list:
    """The JSON values of the event lines (from line 2 on), a batch of lines at a time."""
    rows = []
    batch = []
    number = 2                           # the line number of batch[0]
    for text in itertools.chain(lines, [None]):
        if text is not None:
            batch.append(text)
            if len(batch) < 8192:
                continue
        # Fast path: one json.loads over the batch; on failure, find the bad line.
        try:
            parsed = json.loads("[" + ",".join(batch) + "]")
            if len(parsed) != len(batch):
                raise ValueError("a line holds more than one value")
        except (ValueError, RecursionError):
            parsed = []
            for i, line in enumerate(batch, start=number):
                try:
                    parsed.append(_json(line))
                except ValueError as e:
                    hint = " (the file looks truncated)" if text is None and \
                        i == number + len(batch) - 1 else ""
                    raise ValueError(f"{path}: line {i}: not a valid JSON event{hint}: {e}; "
                                     f"the line starts {line[:60]!r}") from None
        rows += parsed
        number += len(batch)
        batch = []
    return rows


@_deep
def load(path) -> Trace:
    """Read a mempool trace written by :func:`save` (plain or gzip JSON lines).

    Raises
    ------
    ValueError
        For anything that is not a complete, well-formed trace, with a message naming the
        file and the line number: a missing or foreign header, an unsupported version, an
        event line that is not valid JSON or has bad fields, fewer event lines than the
        header declares (a truncated file), or a damaged gzip stream.
    """
    path = os.fspath(path)
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise ValueError(f"{path}: line 1: empty file; expected a mempool-trace header")
    try:
        header = _json(first)
    except ValueError as e:
        raise ValueError(f"{path}: line 1: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path}: line 1: not a mempool trace (expected a header with "
                         f'"format": "{FORMAT}")')
    if not _depth_ok(header):
        raise ValueError(f"{path}: line 1: the header nests deeper than {MAX_NESTING} levels")
    if header.get("version") != VERSION:
        raise ValueError(f"{path}: line 1: trace version {header.get('version')!r:.40} is not "
                         f"supported (this mempool reads version {VERSION})")
    declared = header.get("events")
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int)
                                 or declared < 0):
        raise ValueError(f"{path}: line 1: header 'events' must be an int >= 0; "
                         f"got {declared!r:.40}")
    check_step_starts(header.get("step_starts"), f"{path}: line 1")
    rows = _rows(lines, path)
    events = Trace(meta={k: v for k, v in header.items()
                         if k not in ("format", "version", "events", "fields")})
    append = events.append
    for i, row in enumerate(rows, start=2):
        # Inline the common case; _check_event gives the precise message otherwise.
        if (type(row) is list and len(row) == 5 and row[0] in _BUFFER_ACTIONS
                and type(row[2]) is int and type(row[3]) is int and type(row[4]) is int
                and row[2] >= 0 and row[3] >= 0 and row[4] >= 0
                and type(row[1]) in (int, str) and (row[2] > 0 or row[0] == "free")):
            append(Event(*row))
        else:
            append(_check_event(row, f"{path}: line {i}"))
    if declared is not None and declared != len(events):
        if len(events) < declared:
            raise ValueError(f"{path}: line {len(events) + 2}: the file ends after "
                             f"{len(events)} of the {declared} events its header declares "
                             "(truncated?)")
        raise ValueError(f"{path}: line {declared + 2}: the file holds {len(events)} events "
                         f"but its header declares {declared}")
    return events


# ----------------------------------------------------------------------------------------
# the pool's own recording


def from_pool_history(entries) -> Trace:
    """Events from a pool's recorded history (``Pool.record_history``).

    Parameters
    ----------
    entries : iterable of tuples
        ``(action, ptr, nbytes, stream, time_ns)`` as ``Pool.history()`` returns them, with
        actions named or numbered as ``mempool._core.TRACE_ACTIONS`` (code to name). Only
        allocs, free requests, empty_cache and trim calls are kept: the rest are the pool's
        reactions, which a replay reproduces under its own configuration. Pointers become
        the events' ids; a trim's ``nbytes`` is its ``keep``.
    """
    out = Trace(meta={"source": "mempool"})
    append = out.append
    for n, entry in enumerate(entries):
        try:
            action, ptr, nbytes, stream, time_ns = entry
        except (TypeError, ValueError):
            raise ValueError(f"from_pool_history: entry {n} must be (action, ptr, nbytes, "
                             f"stream, time_ns); got {entry!r}") from None
        try:
            kind = _HISTORY_ACTIONS.get(action)
            if kind is not None:
                append(Event(kind, int(ptr), int(nbytes), int(stream), int(time_ns)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"from_pool_history: entry {n}: (action, ptr, nbytes, stream, "
                             f"time_ns) are a name or code and ints; got {entry!r:.120} "
                             f"({exc})") from None
    return out


def _pool_entries(pool):
    """The recorded entries of `pool`, through whichever accessor the Pool offers."""
    for name in ("history", "trace_entries", "recorded_history"):
        getter = getattr(pool, name, None)
        if callable(getter):
            return getter()
    raise TypeError(f"save_trace: {type(pool).__name__} has no recorded history; "
                    "call pool.record_history(True) before the work to record")


def save_trace(pool, path, meta: dict | None = None) -> int:
    """Save what `pool` has recorded (see ``Pool.record_history``) as a trace file.

    Returns the number of events written. Only allocations, free requests, empty_cache and
    trim calls are saved;
    ``meta`` adds header keys (the pool's backend and options are always included).
    """
    events = from_pool_history(_pool_entries(pool))
    header = {"source": "mempool", "backend": getattr(pool, "backend", None)}
    options = getattr(pool, "options", None)
    if isinstance(options, dict):
        header["options"] = {k: v for k, v in options.items()
                             if isinstance(v, (int, float, str, bool, type(None), list))}
    header.update(meta or {})
    return save(events, path, meta=header)


# ----------------------------------------------------------------------------------------
# PyTorch snapshots


class _SnapshotUnpickler(pickle.Unpickler):
    """Snapshots are plain dicts, lists, tuples, strings and numbers: refuse every global,
    so loading a snapshot file cannot run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a torch memory snapshot holds only plain data; this "
                                     f"pickle refers to {module}.{name}")


def _read_snapshot(path_or_dict):
    if isinstance(path_or_dict, dict):
        return path_or_dict, "<dict>"
    path = os.fspath(path_or_dict)
    raw = io.BytesIO()
    for data in _chunks(path):
        if data is None:
            raise ValueError(f"{path}: the gzip stream is truncated or damaged")
        raw.write(data)
    raw.seek(0)
    try:
        snap = _SnapshotUnpickler(raw).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "not a snapshot"
        why = " ".join(str(e).split())   # pickle's own messages run over several lines
        raise ValueError(f"{path}: not a readable torch memory snapshot pickle "
                         f"({type(e).__name__}: {why:.200})") from None
    if not isinstance(snap, dict):
        raise ValueError(f"{path}: a torch memory snapshot is a dict; got "
                         f"{type(snap).__name__}")
    return snap, path


@_deep
def from_torch_snapshot(path_or_dict, device: int | None = None, complete: bool = True,
                        empty_cache: bool = True) -> Trace:
    """Events from a PyTorch memory snapshot (``torch.cuda.memory._snapshot()``, or the
    pickle that ``_dump_snapshot`` writes).

    Parameters
    ----------
    path_or_dict : str, os.PathLike or dict
        The snapshot dict, or a pickle file of it (gzip allowed). Files are unpickled with
        every global refused, so only plain data loads.
    device : int, optional
        Which entry of ``device_traces`` to import. By default the only non-empty one; a
        snapshot with several non-empty device traces needs `device`.
    complete : bool
        Recording usually starts after some buffers exist. When true (the default), allocs
        are synthesized at the start for the buffers the trace frees without allocating,
        and for those still allocated in the snapshot's ``segments`` that the trace never
        mentions, so the replay's live bytes match the program's.
    empty_cache : bool
        When true (the default), the program's calls for the cache back become
        ``empty_cache`` events (see Notes); their number is ``meta["empty_cache_events"]``.

    Notes
    -----
    ``alloc`` and ``free_requested`` entries become events (sizes are the requested sizes,
    as PyTorch records them; ``time_us`` becomes ``time_ns``). ``free_completed``,
    ``segment_*`` and ``snapshot`` entries are the allocator's own reactions and are
    dropped; ``oom`` entries are counted in ``meta["source_ooms"]``.

    A snapshot does not record ``empty_cache()`` calls, only what they released:
    ``segment_free`` or ``segment_unmap`` entries. PyTorch's cuDNN benchmark calls it after
    every algorithm search (``cudnn.benchmark=True``), dozens of times in a ResNet-50's first
    steps, and a replay without them holds a different layout from the device's
    (docs/expandable.md, "Replays of recorded runs"). :func:`_empty_cache_entries` says
    which releases were such calls; one that released nothing left no entry and is not seen.
    """
    snap, where = _read_snapshot(path_or_dict)
    traces = snap.get("device_traces")
    if not isinstance(traces, list):
        raise ValueError(f"{where}: the snapshot has no 'device_traces' list (was it taken "
                         "with torch.cuda.memory._record_memory_history enabled?)")
    for i, t in enumerate(traces):
        if not isinstance(t, (list, tuple)):
            raise ValueError(f"{where}: device_traces[{i}] must be a list of trace entries; "
                             f"got {type(t).__name__}")
    if device is None:
        nonempty = [i for i, t in enumerate(traces) if t]
        if len(nonempty) > 1:
            counts = ", ".join(f"device {i}: {len(traces[i])} entries" for i in nonempty)
            raise ValueError(f"{where}: the snapshot holds traces for several devices "
                             f"({counts}); pass device= to pick one")
        device = nonempty[0] if nonempty else 0
    if isinstance(device, bool) or not isinstance(device, int) or \
            not 0 <= device < max(len(traces), 1):
        raise ValueError(f"{where}: device must be an int in [0, {max(len(traces), 1)}); "
                         f"got {device!r:.40}")
    entries = traces[device] if traces else []

    events = []
    live = {}                 # addr -> nbytes of buffers allocated in the trace, still live
    seen = set()              # every address the trace mentions
    prelude = {}              # addr -> (nbytes, stream) of buffers live before the trace
    ooms = 0
    settings = snap.get("allocator_settings")
    empty_at = _empty_cache_entries(entries, where, device, settings) if empty_cache else set()
    t0 = None
    for n, e in enumerate(entries):
        if n in empty_at:
            # At the time of the free before it: the release's own time is the allocator's,
            # and a trace's times only order its events.
            events.append(Event("empty_cache", 0, 0, 0, events[-1].time_ns if events else 0))
            continue
        try:
            action = e["action"]
            if action == "oom":
                ooms += 1
                continue
            if action not in ("alloc", "free_requested"):
                continue
            addr, size, stream = int(e["addr"]), int(e["size"]), int(e.get("stream", 0))
            t_us = e.get("time_us", 0) or 0
            t_ns = max(0, int((t_us - (t_us if t0 is None else t0)) * 1000))
            if addr < 0 or stream < 0:
                raise ValueError("a negative address or stream")
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise ValueError(f"{where}: device_traces[{device}][{n}]: a trace entry needs "
                             f"'action', 'addr', 'size' (and 'stream', 'time_us') in a dict, "
                             f"numbers >= 0; got {e!r:.200} ({exc})") from None
        seen.add(addr)
        if t0 is None:
            t0 = t_us
        if action == "alloc":
            if size <= 0:
                continue          # zero-size allocs hand out no memory
            live[addr] = size
            events.append(Event("alloc", addr, size, stream, t_ns))
        else:
            if addr in live:
                del live[addr]
            elif addr not in prelude:
                prelude[addr] = (size, stream)
            else:
                continue          # a second free of a pre-trace buffer: nothing to replay
            events.append(Event("free", addr, size, stream, t_ns))
    synthesized = 0
    if complete:
        start = [Event("alloc", addr, nbytes, stream, 0)
                 for addr, (nbytes, stream) in prelude.items() if nbytes > 0]
        # Buffers allocated before recording and never freed: the snapshot's segments.
        known = set(seen)
        segments = snap.get("segments") or ()
        for k, seg in enumerate(segments if isinstance(segments, list) else ()):
            try:
                if seg.get("device", device) != device:
                    continue
                stream = int(seg.get("stream", 0))
                for b in seg.get("blocks") or ():
                    if b.get("state") != "active_allocated":
                        continue
                    addr = int(b.get("address", 0))
                    if addr in known:
                        continue
                    nbytes = int(b.get("requested_size") or b.get("size") or 0)
                    if nbytes > 0:
                        if addr < 0 or stream < 0:
                            raise ValueError("a negative address or stream")
                        start.append(Event("alloc", addr, nbytes, stream, 0))
                        known.add(addr)
            except (AttributeError, TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{where}: segments[{k}]: a segment is a dict with 'stream' "
                                 f"and 'blocks' (dicts with 'state', 'address', 'size'); got "
                                 f"{seg!r:.200} ({exc})") from None
        synthesized = len(start)
        events = start + events
    meta = {"source": "torch-snapshot", "device": device, "source_ooms": ooms,
            "synthesized_allocs": synthesized, "empty_cache_events": len(empty_at)}
    if isinstance(settings, dict) and settings.get("PYTORCH_CUDA_ALLOC_CONF"):
        meta["pytorch_cuda_alloc_conf"] = str(settings["PYTORCH_CUDA_ALLOC_CONF"])
    return Trace(events, meta)


_RELEASES = ("segment_free", "segment_unmap")
_GROWTHS = ("segment_alloc", "segment_map")


def _empty_cache_entries(entries, where, device, settings) -> set:
    """The indices of the trace entries where the program called ``empty_cache()``: the first
    release entry of each call.

    An allocator releases by itself only while it serves an allocation, and records that
    release just before the allocation; so a release whose last request before it is a free
    is an ``empty_cache`` call, unless the allocation after it maps memory apart from what
    was released: mempool's high-water rule releases idle memory elsewhere before a growth
    (never the pages the growth joins), and so do PyTorch's garbage collection
    (``garbage_collection_threshold``) and its retry after a failed device allocation. Such
    a release counts as a call only in a snapshot of PyTorch's own allocator without
    garbage collection, whose retry shows an ``oom`` only when it fails: with a device far
    from full that is the program's call too. On recorded ResNet-50 runs under cuDNN
    benchmark this finds 60-70 calls per run, and a replay with them reproduces the
    device's peak reserved bytes to the byte (tests/tools/test_replay_empty_cache.py).
    """
    def regions(kinds):
        """The [start, end] of the entries of `kinds` from n on (completed frees between
        them skipped), and n moved past them."""
        nonlocal n
        out = []
        while n < len(entries) and entries[n]["action"] in kinds + ("free_completed",):
            if entries[n]["action"] in kinds:
                a = int(entries[n]["addr"])
                out.append((a, a + int(entries[n]["size"])))
            n += 1
        return out

    settings = settings if isinstance(settings, dict) else {}
    by_mempool = settings.get("PYTORCH_CUDA_ALLOC_CONF") == "mempool"
    gc = settings.get("garbage_collection_threshold")
    collects = isinstance(gc, (int, float)) and not isinstance(gc, bool) and gc > 0
    apart_counts = not by_mempool and not collects
    found = set()
    last = None               # the last request entry: "alloc" or "free_requested"
    n = 0
    try:
        while n < len(entries):
            action = entries[n]["action"]
            if action not in _RELEASES or last != "free_requested":
                if action in ("alloc", "free_requested"):
                    last = action
                n += 1
                continue
            first = n
            released = regions(_RELEASES)
            mapped = regions(_GROWTHS)
            # Touching counts as joined: a growth maps next to the free block it extends.
            joined = any(r0 <= m1 and m0 <= r1 for r0, r1 in released for m0, m1 in mapped)
            if not mapped or joined or apart_counts:
                found.add(first)
            last = None
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise ValueError(f"{where}: device_traces[{device}][{n}]: a segment entry needs "
                         f"'action', 'addr' and 'size'; got {entries[n]!r:.200} "
                         f"({exc})") from None
    return found


# ----------------------------------------------------------------------------------------
# RMM logs

_RMM_COLUMNS = ("Time", "Action", "Pointer", "Size", "Stream")


_RMM_INT = re.compile(r"0[xX][0-9a-fA-F]+|[0-9]+", re.ASCII)
_RMM_TIME = re.compile(r"(?:([0-9]+):([0-9]+):)?([0-9]+)(?:\.([0-9]*))?", re.ASCII)


def _rmm_int(text: str) -> int:
    """A pointer, size or stream: decimal or 0x hex, >= 0 (a sign is refused: save would
    refuse the trace that a negative value makes)."""
    text = text.strip()
    if text in ("", "(nil)", "nullptr"):
        return 0
    if not _RMM_INT.fullmatch(text):
        raise ValueError(f"{text[:40]!r} is not an int >= 0 (decimal or 0x hex)")
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def _rmm_time_ns(text: str) -> int:
    """RMM writes ``HH:MM:SS.ffffff`` (spdlog ``%H:%M:%S.%f``); seconds as a float also pass."""
    m = _RMM_TIME.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"time {text[:40]!r} is neither HH:MM:SS.ffffff nor seconds")
    h, mins, sec, frac = m.groups()
    whole = (int(h or 0) * 60 + int(mins or 0)) * 60 + int(sec)
    return whole * 1_000_000_000 + int(((frac or "") + "000000000")[:9])


@_deep
def from_rmm_csv(path) -> Trace:
    """Events from the CSV log of RMM's ``logging_resource_adaptor``.

    The columns are found by the header (``Thread,Time,Action,Pointer,Size,Stream``);
    actions ``allocate`` and ``free`` (or ``deallocate``) become events, ``allocate failure``
    rows are counted in ``meta["source_ooms"]``. Pointers become ids; times
    (``HH:MM:SS.ffffff``, wrapping at midnight) become ns from the first row.

    Raises
    ------
    ValueError
        Naming the file and line for a missing column, an unknown action or a value that
        does not parse.
    """
    path = os.fspath(path)
    try:
        return _rmm_events(path)
    except csv.Error as e:
        raise ValueError(f"{path}: not a readable CSV log ({e})") from None


def _rmm_events(path: str) -> Trace:
    # Lines from _lines: bounded, gzip allowed; a field longer than the csv module's limit
    # (128 KiB) is a csv.Error, made a ValueError by the caller.
    reader = csv.reader(_lines(path))
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{path}: line 1: empty file; expected RMM's CSV header "
                         "Thread,Time,Action,Pointer,Size,Stream") from None
    names = [h.strip() for h in header]
    missing = [c for c in _RMM_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path}: line 1: not an RMM log: columns {missing} are missing "
                         f"(header {names!r:.200}; expected Thread,Time,Action,Pointer,Size,"
                         "Stream)")
    col = {c: names.index(c) for c in _RMM_COLUMNS}
    width = max(col.values()) + 1
    events = []
    ooms = 0
    t0 = None
    day = 0
    last = None
    for row in reader:
        line = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) < width:
            raise ValueError(f"{path}: line {line}: expected {len(names)} columns, got "
                             f"{len(row)} (the file looks truncated): {row!r:.200}")
        action = row[col["Action"]].strip()
        try:
            ptr = _rmm_int(row[col["Pointer"]])
            size = _rmm_int(row[col["Size"]])
            stream = _rmm_int(row[col["Stream"]])
            t = _rmm_time_ns(row[col["Time"]])
        except ValueError as e:
            raise ValueError(f"{path}: line {line}: a value does not parse ({e}): "
                             f"{row!r:.200}") from None
        if last is not None and t + day < last - 3600 * 10**9:
            day += 86400 * 10**9       # the clock passed midnight
        t += day
        last = t
        if t0 is None:
            t0 = t
        # Rows logged by several threads may step back a little: never before the first.
        if action == "allocate":
            events.append(Event("alloc", ptr, size, stream, max(0, t - t0)))
        elif action in ("free", "deallocate"):
            events.append(Event("free", ptr, size, stream, max(0, t - t0)))
        elif action == "allocate failure":
            ooms += 1
        else:
            raise ValueError(f"{path}: line {line}: unknown action {action!r:.40} (RMM logs "
                             "'allocate', 'free' and 'allocate failure')")
    events = [ev for ev in events if ev.action == "free" or ev.nbytes > 0]
    return Trace(events, {"source": "rmm-csv", "source_ooms": ooms})


# ----------------------------------------------------------------------------------------
# any of the above, by content


@_deep
def load_any(path) -> Trace:
    """Load a trace in any supported format, recognised by content (not only the name):
    a mempool trace (JSON lines, optionally gzip), a torch snapshot pickle or an RMM CSV.

    A file that cannot be opened is an OSError; anything else wrong with it (not a trace,
    damaged, truncated, nested too deeply, larger than MAX_INPUT_BYTES once inflated, a line
    over MAX_LINE_BYTES) is a ValueError naming the file, in one line.
    """
    path = os.fspath(path)
    head = b""
    for data in _chunks(path):
        if data is None:
            head = head or b"{"    # let load() report the damage with a line number
            break
        head += data
        if len(head) >= 4096:
            break
    if head[:1] == b"\x80" or path.endswith((".pickle", ".pkl")):
        return from_torch_snapshot(path)
    if head.lstrip()[:1] == b"{":
        return load(path)
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    if "Action" in first and "Pointer" in first:
        return from_rmm_csv(path)
    raise ValueError(f"{path}: line 1: not a recognised trace (expected a mempool trace "
                     "header, a torch memory snapshot pickle, or an RMM CSV log header)")
