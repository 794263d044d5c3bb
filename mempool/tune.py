"""Search pool settings that reserve the least memory for a trace.

``tune(events)`` replays a trace on the simulated device once per point of a grid of
settings and ranks the points: fewest OOMs first, then settings without upstream churn (far more
segment allocations and frees than the default: each is a ``cudaMalloc``-class call on a
real device), then least peak reserved memory, then fewest upstream calls, then the fewest
settings changed. The default configuration is always replayed, and a setting ranks above
it only when its replay has no more OOMs, no more peak reserved memory and no churn, so the
recommendation is never worse than leaving the pool alone. Same trace, same grid: same
ranking.
"""
from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass

from . import replay as _replay

__all__ = ["TuneResult", "tune", "report", "churn_limit", "DEFAULT_GRID", "to_conf",
           "to_pytorch_conf"]

MiB = 1 << 20
GiB = 1 << 30

# None = leave the option at the pool's default (the key is omitted).
DEFAULT_GRID = {
    "roundup_power2_divisions": [None, 2, 4, 8, "[256:1,512:2,1024:4,>:8]"],
    "max_split_size": [None, 64 * MiB, 256 * MiB],
    "expandable_segments": [None, True],
    "release_threshold": [None, 0, 1 * GiB],
    # Only meaningful under a limit: tune() drops it when none is given.
    "garbage_collection_threshold": [None, 0.8],
}
TUNABLE = tuple(DEFAULT_GRID)


@dataclass
class TuneResult:
    """One point of the grid and what its replay measured."""

    options: dict                  # the non-default settings; {} is the default
    conf: str                      # the same as a MEMPOOL_CONF string ("" = the default)
    pytorch_conf: str | None       # the nearest PYTORCH_CUDA_ALLOC_CONF, None if none
    result: _replay.ReplayResult | None
    skipped: str | None = None     # why the pool refused these settings, if it did
    churn: bool = False            # far more upstream calls than the default (see tune)

    @property
    def is_default(self) -> bool:
        return not self.options

    def key(self, order: int):
        r = self.result
        return (r.num_ooms > 0, r.num_ooms, self.churn, r.peak_reserved_bytes,
                r.num_device_alloc + r.num_device_free, len(self.options), order)

    def __str__(self) -> str:
        if self.result is None:
            return f"{self.conf or '(default)'}: skipped ({self.skipped})"
        return f"{self.conf or '(default)'}: {self.result}"


# ----------------------------------------------------------------------------------------
# configuration strings


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", GiB), ("MB", MiB), ("KB", 1024)):
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _local_to_conf(options: dict) -> str:
    parts = []
    for key, value in options.items():
        if isinstance(value, bool):
            value = "True" if value else "False"
        elif key in ("max_split_size", "release_threshold", "limit", "initial_pool_size") \
                and isinstance(value, int):
            value = _size(value)
        parts.append(f"{key}:{value}")
    return ",".join(parts)


def _local_to_pytorch_conf(options: dict):
    parts = []
    for key, value in options.items():
        if key == "max_split_size":
            parts.append(f"max_split_size_mb:{max(1, value // MiB)}")
        elif key == "expandable_segments":
            parts.append(f"expandable_segments:{'True' if value else 'False'}")
        elif key in ("roundup_power2_divisions", "garbage_collection_threshold"):
            parts.append(f"{key}:{value}")
        # release_threshold and limit have no PYTORCH_CUDA_ALLOC_CONF key.
    return ",".join(parts) if parts else None


def to_conf(options: dict) -> str:
    """`options` as a ``MEMPOOL_CONF`` / ``Pool.from_conf`` string."""
    try:
        from ._config import to_conf as impl
    except ImportError:
        return _local_to_conf(options)
    return impl(options)


def to_pytorch_conf(options: dict):
    """The nearest ``PYTORCH_CUDA_ALLOC_CONF`` for `options` (None when PyTorch has none of
    them; ``release_threshold`` has no PyTorch counterpart in its native allocator)."""
    try:
        from ._config import to_pytorch_conf as impl
    except ImportError:
        return _local_to_pytorch_conf(options)
    return impl(options) or None


# ----------------------------------------------------------------------------------------


def _normalize():
    """The option validator, when the config module is present."""
    try:
        from ._config import normalize
    except ImportError:
        return None
    return normalize


def _overridden():
    """The check for settings another one overrides, when the config module is present."""
    try:
        from ._config import overridden
    except ImportError:
        return None
    return overridden


def churn_limit(default_calls: int, events: int) -> int:
    """Upstream calls (segment allocations + frees) beyond which a setting counts as churn.

    On a real device every upstream call is a ``cudaMalloc``/``cudaFree`` (tens of µs; a
    free synchronizes), so a setting that saves memory by returning segments after every
    step (``release_threshold:0``) trades a little memory for a lot of time. Such settings
    rank after every setting without churn and never above the default. The bar is four
    times the default's calls plus one per 100 events: expandable segments, which map and
    unmap pages, stay well under it; releasing every free segment does not.
    """
    return 4 * default_calls + events // 100


def _candidates(grid: dict) -> tuple:
    """Every point of the grid as a dict of its non-default settings, the default first,
    each distinct point once; and how many points were left out because their settings do
    not combine (e.g. expandable segments with a max_split_size)."""
    overridden = _overridden()
    keys = list(grid)
    seen = {()}
    out = [{}]
    left_out = 0
    for values in itertools.product(*(grid[k] for k in keys)):
        point = {k: v for k, v in zip(keys, values) if v is not None}
        ident = tuple(sorted((k, repr(v)) for k, v in point.items()))
        if ident in seen:
            continue
        seen.add(ident)
        if overridden is not None:
            # A point where one setting overrides another is the same as one without it.
            try:
                if overridden(point):
                    left_out += 1
                    continue
            except ValueError:
                left_out += 1
                continue
        out.append(point)
    return out, left_out


def _check_grid(grid) -> dict:
    if grid is None:
        return {k: list(v) for k, v in DEFAULT_GRID.items()}
    if not isinstance(grid, dict):
        raise ValueError(f"tune: grid must be a dict of option -> list of values; got "
                         f"{type(grid).__name__}")
    out = {}
    for key, values in grid.items():
        if key not in TUNABLE:
            raise ValueError(f"tune: grid key {key!r} is not a tunable option; accepted: "
                             f"{', '.join(TUNABLE)}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            values = [values]
        out[key] = list(values)
        if not out[key]:
            raise ValueError(f"tune: grid[{key!r}] is empty; give at least one value "
                             "(None = the default)")
    normalize = _normalize()
    if normalize is not None:
        for key, values in out.items():
            for v in values:
                if v is not None:
                    try:
                        normalize({key: v})
                    except ValueError as e:
                        raise ValueError(f"tune: grid[{key!r}] holds a bad value: {e}") from None
    return out


class _Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line every
    tenth of the way otherwise."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.last_decile = -1

    def update(self, done: int, best: str) -> None:
        if not self.enabled:
            return
        frac = done / self.total if self.total else 1.0
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        text = (f"tune [{bar}] {done}/{self.total}  {elapsed:5.1f}s elapsed, "
                f"{eta:5.1f}s left  best: {best}")
        if self.tty:
            self.stream.write("\r" + text[:160].ljust(160))
            if done == self.total:
                self.stream.write("\n")
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(text + "\n")
        self.stream.flush()


def tune(events, limit=None, grid=None, progress: bool = True, capacity=None,
         stream=None) -> list:
    """Replay `events` on sim under every point of `grid`; return the points ranked, best first.

    Parameters
    ----------
    events : Trace, iterable of Event, or mempool.replay.Prepared
        The trace to tune for.
    limit : int, str or float, optional
        Replay under this cap on reserved bytes (the GPU's size, or a share of it), so
        settings that would run out of memory rank last. Without a limit,
        ``garbage_collection_threshold`` (a fraction of the limit) is left out of the grid.
    grid : dict, optional
        Option name -> list of values to try; None in a list means the pool's default.
        Options: ``roundup_power2_divisions``, ``max_split_size``, ``expandable_segments``,
        ``release_threshold``, ``garbage_collection_threshold``. Default :data:`DEFAULT_GRID`.
        The default configuration is always tried, whatever the grid.
    progress : bool
        Draw a progress bar on stderr.
    capacity : int or str, optional
        The simulated device's size (the pool's default when None).

    Returns
    -------
    list of TuneResult
        Ranked: fewest OOMs, then no upstream churn (:func:`churn_limit`), then least peak
        reserved, then fewest upstream calls, then fewest changed settings. Points the pool refused (for instance expandable
        segments where they are not available) come last with ``skipped`` set. The first
        entry is the recommendation; it is the default itself unless a point has no more
        OOMs, no more peak reserved bytes and no churn (and ranks higher).
    """
    grid = _check_grid(grid)
    if limit is None and grid.get("garbage_collection_threshold") == \
            DEFAULT_GRID["garbage_collection_threshold"]:
        grid["garbage_collection_threshold"] = [None]
    prep = _replay.prepare(events)
    points, _ = _candidates(grid)
    extra = {} if capacity is None else {"capacity": capacity}
    bar = _Progress(len(points), progress, stream)
    done = []
    skipped = []
    unsupported = {}             # option -> reason, once one value of it is refused
    best_text = "-"
    for i, point in enumerate(points):
        reason = next((unsupported[k] for k in point if k in unsupported), None)
        result = None
        if reason is None:
            try:
                result = _replay.replay(prep, conf=dict(point), backend="sim", limit=limit,
                                        **extra)
            except (NotImplementedError, ValueError) as e:
                if not point:
                    raise              # the default configuration must replay
                reason = f"{type(e).__name__}: {e}"
                if len(point) == 1:
                    unsupported[next(iter(point))] = reason
        item = TuneResult(options=point, conf=to_conf(point), pytorch_conf=to_pytorch_conf(point),
                          result=result, skipped=reason)
        if result is None:
            skipped.append(item)
        else:
            done.append((item, i))
            best = min(done, key=lambda p: p[0].key(p[1]))[0]
            best_text = f"{best.result.ratio:.3f} ({best.conf or 'default'})"
        bar.update(i + 1, best_text)
    default = done[0][0]
    calls = default.result.num_device_alloc + default.result.num_device_free
    for item, _ in done:
        r = item.result
        item.churn = r.num_device_alloc + r.num_device_free > churn_limit(calls, r.events)

    def rank(pair):
        # A point outranks the default only if it has no more OOMs, no more peak reserved
        # memory and no upstream churn; upstream calls and simplicity break ties.
        item, order = pair
        k = item.key(order)
        d = default.result
        no_worse = (item.result.num_ooms <= d.num_ooms and not item.churn
                    and item.result.peak_reserved_bytes <= d.peak_reserved_bytes)
        return (not no_worse and not item.is_default,) + k
    ranked = [item for item, _ in sorted(done, key=rank)]
    return ranked + skipped


def report(results: list, top: int = 10) -> str:
    """A table of the best `top` results and the recommendation, as text."""
    gib = float(GiB)
    default = next((r for r in results if r.is_default), None)
    lines = [f"{'rank':>4}  {'reserved GiB':>12}  {'res/live':>8}  {'vs default':>10}  "
             f"{'OOMs':>4}  {'upstream':>8}  settings"]
    shown = [r for r in results if r.result is not None][:top]
    for n, r in enumerate(shown, 1):
        rr = r.result
        vs = (rr.peak_reserved_bytes / default.result.peak_reserved_bytes - 1) * 100 \
            if default and default.result.peak_reserved_bytes else 0.0
        calls = f"{rr.num_device_alloc + rr.num_device_free}{'*' if r.churn else ''}"
        lines.append(f"{n:>4}  {rr.peak_reserved_bytes / gib:>12.3f}  {rr.ratio:>8.3f}  "
                     f"{vs:>+9.1f}%  {rr.num_ooms:>4}  {calls:>8}  {r.conf or '(default)'}")
    if any(r.churn for r in shown):
        lines.append("* upstream churn: far more segment allocations and frees than the "
                     "default (slow on a real GPU); ranked after settings without it")
    skipped = [r for r in results if r.result is None]
    if skipped:
        lines.append(f"skipped {len(skipped)} settings the pool refused, e.g. "
                     f"{skipped[0].conf}: {skipped[0].skipped}")
    if results and results[0].result is not None:
        best = results[0]
        lines.append("")
        lines.append(f"MEMPOOL_CONF={best.conf}" if best.conf else
                     "MEMPOOL_CONF unset: the defaults are best for this trace")
        if best.conf:
            if best.pytorch_conf:
                lines.append(f"nearest PYTORCH_CUDA_ALLOC_CONF={best.pytorch_conf}")
            else:
                lines.append("PyTorch's allocator has no equivalent of these settings")
    return "\n".join(lines)
