"""Recorded runs to corpus traces: step marks taken out, ids made small, the size capped.

A recorded workload marks the start of each step with two allocations of sizes no tensor
of a model takes (``workloads.MARKS``), freed at once. :func:`take_marks` removes them and
keeps where they stood as the trace's ``step_starts``; :func:`compact` renames buffers and
streams to small integers in order of appearance (a one-to-one renaming: the replay sees
the same trace) and rounds times to microseconds, which is what makes a trace of tens of
thousands of events a file of a few hundred KB; :func:`finish` does both and writes the
file, cut at a step start where it would be too large.
"""
from __future__ import annotations

import os

from mempool.tools import trace as mtrace
from workloads import MARKS

MAX_EVENTS = 40_000
MAX_BYTES = 300 * 1024


def take_marks(events) -> tuple:
    """(events without the marks, step_starts): each step start is the index, in the events
    returned, of the first event after a mark (an alloc of MARKS[0] followed at once by an
    alloc of MARKS[1]); the marks' frees go too."""
    out, starts, marked = [], [], set()
    i, n = 0, len(events)
    while i < n:
        ev = events[i]
        if (ev.action == "alloc" and ev.nbytes == MARKS[0] and i + 1 < n
                and events[i + 1].action == "alloc" and events[i + 1].nbytes == MARKS[1]):
            starts.append(len(out))
            marked.update((ev.id, events[i + 1].id))
            i += 2
            continue
        if ev.action == "free" and ev.id in marked:
            marked.discard(ev.id)
        else:
            out.append(ev)
        i += 1
    return out, starts


def compact(events) -> list:
    """The same trace with ids and non-default streams renamed 1, 2, ... in order of first
    appearance (stream 0 stays 0) and times from the first event, in whole microseconds."""
    ids, streams = {}, {0: 0}
    t0 = events[0].time_ns if events else 0
    out = []
    for ev in events:
        ident = ev.id
        if ev.action in ("alloc", "free"):
            ident = ids.setdefault(ev.id, len(ids) + 1)
        stream = streams.setdefault(ev.stream, len(streams))
        t = max(0, ev.time_ns - t0) // 1000 * 1000
        out.append(mtrace.Event(ev.action, ident, ev.nbytes, stream, t))
    return out


def cap(events, starts, max_events: int) -> tuple:
    """(events, starts) cut at the last step start at or below `max_events` events, when
    there are more; never below one whole step (the events up to the second start)."""
    if len(events) <= max_events or len(starts) < 2:
        return events, starts
    fits = [s for s in starts[1:] if s <= max_events]
    cut = fits[-1] if fits else starts[1]
    return events[:cut], [s for s in starts if s < cut]


def peak_live(events) -> int:
    """The most bytes live at once (requested sizes), as a replay counts them."""
    live, now, peak = {}, 0, 0
    for ev in events:
        if ev.action == "alloc":
            now -= live.pop(ev.id, 0)       # an alloc of a live id replaces it
            live[ev.id] = ev.nbytes
            now += ev.nbytes
            peak = max(peak, now)
        elif ev.action == "free":
            now -= live.pop(ev.id, 0)
    return peak


def finish(events, meta: dict, path: str, max_events: int = MAX_EVENTS,
           max_bytes: int = MAX_BYTES) -> dict:
    """Write the corpus trace of a recorded run to `path` (meta its header) and return the
    header as written plus ``file_bytes``; steps recorded beyond what fits `max_events`
    events and `max_bytes` bytes are left out (``meta["steps_recorded"]`` says how many the
    run had)."""
    body, starts = take_marks(list(events))
    body = compact(body)
    recorded = len(starts)
    limit = max_events
    while True:
        kept, kept_starts = cap(body, starts, limit)
        header = dict(meta, step_starts=kept_starts, steps=len(kept_starts),
                      steps_recorded=recorded, peak_live_bytes=peak_live(kept))
        mtrace.save(kept, path, meta=header)
        size = os.path.getsize(path)
        if size <= max_bytes or len(kept_starts) <= 1 or len(kept) < 2:
            return dict(header, events=len(kept), file_bytes=size)
        # Over the size: cut to the share of events that fits, and at least one step less.
        limit = min(len(kept) * max_bytes // size, kept_starts[-1])
