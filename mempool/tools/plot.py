"""Pictures of a pool: a snapshot's segment map, or a trace's memory over time.

``plot(snapshot, "map.png")`` draws every segment of a snapshot (``Pool.snapshot()`` or
``torch.cuda.memory._snapshot()``: the same format) as a bar split into its blocks, coloured
by state, grouped by stream. ``plot(trace_or_result, "timeline.png")`` draws live and
reserved bytes over a replay. matplotlib is an optional dependency, needed only here; the
figure is drawn without pyplot, so no global matplotlib state changes.
"""
from __future__ import annotations

import os

__all__ = ["plot", "plot_segments", "plot_timeline", "image_path"]

from mempool._units import format_bytes as _size

GiB = float(1 << 30)
MAX_ROWS = 24            # segments drawn; the figure stays under ~1,100 px tall
MIN_WIDTH = 0.003        # share of a row: the narrowest block drawn
BOUNDARY = "#222222"     # the line between two blocks

# Block states in the torch snapshot vocabulary, and how to draw them.
STATES = {
    "active_allocated": ("allocated", "#1f77b4", None),
    "active_pending_free": ("pending free (waiting on a stream)", "#ff7f0e", None),
    "active_awaiting_free": ("pending free (waiting on a stream)", "#ff7f0e", None),
    "inactive": ("free (cached)", "#d9d9d9", None),
    "unmapped": ("unmapped (expandable, no memory)", "white", "////"),
}


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("mempool.tools.plot needs matplotlib, which is not installed: "
                          "pip install matplotlib") from None
    return Figure, FigureCanvasAgg, Patch


def image_path(out) -> str:
    """The file a plot is written to: `out`, with ``.png`` added when it has no extension
    (as matplotlib adds it), so that what is reported is the file written."""
    out = os.fspath(out)
    return out if os.path.splitext(out)[1] else out + ".png"


def _check_segments(segments) -> None:
    """Each segment a dict with an int ``total_size`` >= 0 and ``blocks``, dicts with an
    int ``size`` >= 0: checked before anything is drawn, for a one-line ValueError."""
    def size_ok(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    for k, seg in enumerate(segments):
        blocks = seg.get("blocks") if isinstance(seg, dict) else None
        if not (isinstance(seg, dict) and size_ok(seg.get("total_size"))
                and size_ok(seg.get("stream", 0)) and size_ok(seg.get("address", 0))
                and isinstance(blocks or [], list)
                and all(isinstance(b, dict) and size_ok(b.get("size")) for b in blocks or ())):
            raise ValueError(f"plot: segments[{k}]: a segment is a dict with 'total_size', "
                             "'stream', 'address' (ints >= 0) and 'blocks' (dicts with an "
                             f"int 'size' >= 0); got {seg!r:.200}")


def _save(fig, canvas_cls, out) -> str:
    out = image_path(out)
    canvas_cls(fig)
    fig.savefig(out, dpi=110)
    return out


def plot_segments(snapshot: dict, out, title: str | None = None, device: int | None = None) -> str:
    """Draw the segment map of a snapshot dict to `out` (PNG, SVG or PDF by extension).

    Each row is one segment, its blocks drawn to scale within it (the x axis is the offset
    as a share of the segment, so a 2 MiB segment is as readable as a 2 GiB one; the size and
    block count are written at the row's end), a dark line at every boundary between two
    blocks. Rows are grouped by stream, largest segment first; beyond MAX_ROWS (24) rows the
    smallest segments are summarised in the title, so the figure's size is bounded.
    """
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments") or [], list):
        raise ValueError("plot: a snapshot is a dict whose 'segments' is a list")
    _check_segments(snapshot.get("segments") or ())
    segments = [s for s in snapshot.get("segments") or ()
                if device is None or s.get("device", device) == device]
    Figure, Canvas, Patch = _matplotlib()
    if not segments:
        raise ValueError("plot: the snapshot has no segments to draw (an empty pool?)")
    segments = sorted(segments, key=lambda s: (int(s.get("stream", 0)), -int(s["total_size"]),
                                               int(s.get("address", 0))))
    hidden = []
    if len(segments) > MAX_ROWS:
        keep = sorted(segments, key=lambda s: -int(s["total_size"]))[:MAX_ROWS]
        keep_ids = {id(s) for s in keep}
        hidden = [s for s in segments if id(s) not in keep_ids]
        segments = [s for s in segments if id(s) in keep_ids]
    totals = {}
    used_states = []
    for seg in segments + hidden:
        for b in seg.get("blocks") or ():
            name = STATES.get(b.get("state", "inactive"), STATES["inactive"])[0]
            totals[name] = totals.get(name, 0) + int(b["size"])
            if name not in used_states:
                used_states.append(name)
    rows = len(segments)
    height = 2.6 + 0.32 * rows
    fig = Figure(figsize=(12, height))
    ax = fig.add_subplot(1, 1, 1)
    labels = []
    free_color = STATES["inactive"][1]
    for y, seg in enumerate(segments):
        total = int(seg["total_size"])
        # The segment's whole extent first (free), then every other block on top, at least
        # MIN_WIDTH wide so a 512 B allocation in a 2 MiB segment still shows.
        ax.barh(y, 1.0, left=0.0, height=0.8, color=free_color, linewidth=0)
        offset = 0
        boundaries = []
        for b in seg.get("blocks") or ():
            if offset:
                boundaries.append(offset / total)
            state = b.get("state", "inactive")
            name, color, hatch = STATES.get(state, STATES["inactive"])
            size = int(b["size"])
            if state != "inactive":
                ax.barh(y, max(size / total, MIN_WIDTH), left=offset / total, height=0.8,
                        color=color, edgecolor="#555555" if hatch else color, hatch=hatch,
                        linewidth=0.3)
            offset += size
        if offset < total:          # space the snapshot does not describe
            ax.barh(y, (total - offset) / total, left=offset / total, height=0.8,
                    color="white", edgecolor="#999999", linewidth=0.3)
        ax.vlines(boundaries, y - 0.4, y + 0.4, colors=BOUNDARY, linewidth=0.7)
        kind = "expandable" if seg.get("is_expandable") else seg.get("segment_type", "")
        labels.append(f"stream {int(seg.get('stream', 0)):#x}, {kind}")
        nblocks = len(seg.get("blocks") or ())
        ax.text(1.01, y, f"{_size(total)}, {nblocks} block{'s' if nblocks != 1 else ''}",
                va="center", fontsize=8.5)
    ax.set_yticks(range(rows))
    ax.set_yticklabels(labels, fontsize=8.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, 1)
    ax.set_xlabel("offset within the segment (share of its size); dark lines: block "
                  "boundaries; size and block count at the right", fontsize=9)
    ax.xaxis.set_major_formatter(_percent())
    # Separators between streams.
    streams = [int(s.get("stream", 0)) for s in segments]
    for y in range(1, rows):
        if streams[y] != streams[y - 1]:
            ax.axhline(y - 0.5, color="black", linewidth=0.8)
    reserved = sum(int(s["total_size"]) for s in segments) + \
        sum(int(s["total_size"]) for s in hidden)
    head = title or "segment map"
    sub = f"{len(segments) + len(hidden)} segments, {_size(reserved)} reserved\n" + ", ".join(
        f"{name}: {_size(n)}" for name, n in totals.items())
    if hidden:
        sub += (f"\n{len(hidden)} smaller segments "
                f"({_size(sum(int(s['total_size']) for s in hidden))}) not drawn")
    ax.set_title(f"{head}\n{sub}", fontsize=10)
    handles = [Patch(facecolor=STATES[k][1], edgecolor="#555555", hatch=STATES[k][2],
                     label=STATES[k][0])
               for k in ("active_allocated", "active_pending_free", "inactive", "unmapped")
               if STATES[k][0] in used_states]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9,
               frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 0.93, 1))
    return _save(fig, Canvas, out)


def _percent():
    from matplotlib.ticker import FuncFormatter
    return FuncFormatter(lambda v, _: f"{v * 100:.0f}%")


def plot_timeline(result, out, title: str | None = None) -> str:
    """Draw live and reserved bytes over a replay (a ReplayResult with a time series)."""
    Figure, Canvas, _ = _matplotlib()
    series = result.timeseries
    if not series:
        raise ValueError("plot: this replay has no time series; replay with timeseries=True")
    import numpy as np

    t = np.asarray(series["time_ns"], dtype=np.float64)
    if len(t) > 1 and t[-1] > t[0]:
        x, xlabel = (t - t[0]) / 1e6, "time (ms, as recorded in the trace)"
    else:
        x, xlabel = np.asarray(series["event"], dtype=np.float64), "event"
    live = np.asarray(series["live_bytes"], dtype=np.float64) / GiB
    reserved = np.asarray(series["reserved_bytes"], dtype=np.float64) / GiB
    fig = Figure(figsize=(11, 4.8))
    ax = fig.add_subplot(1, 1, 1)
    ax.fill_between(x, 0, reserved, step="post", color="#ff7f0e", alpha=0.25)
    ax.step(x, reserved, where="post", color="#d62728", linewidth=1.0,
            label=f"reserved (peak {_size(result.peak_reserved_bytes)})")
    ax.fill_between(x, 0, live, step="post", color="#1f77b4", alpha=0.35)
    ax.step(x, live, where="post", color="#1f77b4", linewidth=1.0,
            label=f"live, requested (peak {_size(result.peak_live_bytes)})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GiB")
    ax.set_xlim(x[0] if len(x) else 0, x[-1] if len(x) else 1)
    ax.set_ylim(0, max(reserved.max(initial=0), live.max(initial=0)) * 1.08 or 1)
    ax.grid(True, alpha=0.3)
    conf = getattr(result, "conf_text", None) or _conf_text(result.options)
    head = title or "memory over the replay"
    ax.set_title(f"{head}\n{result.events} events on {result.backend}, {conf}; "
                 f"peak reserved / peak live = {result.ratio:.3f} (lower is better), "
                 f"{result.num_ooms} OOMs",
                 fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, Canvas, out)


def _conf_text(options: dict) -> str:
    """The settings that shape fragmentation, as a conf string ("default settings" if none
    differs from its default)."""
    from .tune import to_conf

    keys = ("roundup_power2_divisions", "max_split_size", "expandable_segments",
            "release_threshold", "garbage_collection_threshold", "limit")
    try:
        text = to_conf({k: v for k, v in (options or {}).items() if k in keys})
    except ValueError:
        text = ""
    return text or "default settings"


def plot(snapshot_or_trace, out, title: str | None = None, conf=None) -> str:
    """Draw a snapshot's segment map, or a trace's (or replay's) memory over time, to `out`.

    Parameters
    ----------
    snapshot_or_trace : dict, ReplayResult, Trace, list of events, or a path
        A snapshot dict (has ``"segments"``) gives the segment map. A ReplayResult with a
        time series gives its timeline; a trace is first replayed on sim (under `conf`) to
        get one. A path is loaded by content: a torch snapshot pickle with segments is drawn
        as a map, any trace (mempool JSONL, torch snapshot's trace, RMM CSV) as a timeline.
    out : str or os.PathLike
        The image file; the format follows its extension (``.png``, ``.svg``, ``.pdf``).
    conf : str or dict, optional
        Pool options for replaying a trace.

    Returns
    -------
    str
        The file written: `out`, with ``.png`` added when it has no extension.
    """
    from . import replay as _replay
    from . import trace as _trace

    obj = snapshot_or_trace
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        with _trace._open_checked(path) as f:
            magic = f.read(2)
        if magic[:1] == b"\x80" or path.endswith((".pickle", ".pkl")):
            snap, _ = _trace._read_snapshot(path)
            if snap.get("segments"):
                return plot_segments(snap, out, title=title or os.path.basename(path))
        obj = _trace.load_any(path)
        title = title or os.path.basename(path)
    if isinstance(obj, dict):
        return plot_segments(obj, out, title=title)
    if isinstance(obj, _replay.ReplayResult):
        if obj.timeseries is None:
            raise ValueError("plot: this ReplayResult has no time series; replay with "
                             "timeseries=True")
        return plot_timeline(obj, out, title=title)
    result = _replay.replay(obj, conf=conf, backend="sim", timeseries=True)
    return plot_timeline(result, out, title=title)
