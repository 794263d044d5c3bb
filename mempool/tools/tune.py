"""Search pool settings that reserve the least memory for a trace.

``tune(events)`` replays a trace on the simulated device once per point of a grid of
settings and ranks the points by one key, the same for the progress line and the final
table: fewest OOMs first (under a limit, a setting that fits more of the trace always wins),
then settings without upstream churn (far more segment allocations and frees than the
default: each is a ``cudaMalloc``-class call on a real device), then least peak reserved
memory, then fewest upstream calls, then the fewest settings changed. The default
configuration is always replayed, so the recommendation never has more OOMs than leaving the
pool alone, and with as many OOMs it reserves no more and has no churn. A setting that beats
a higher-ranked one on OOMs and memory but ranks below it because of churn carries the rule
in ``TuneResult.rule``; :func:`report` lists such settings, and every setting the pool
refused, with the reason. Same trace, same grid: same ranking.
"""
from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass

from mempool._config import _checked, _overridden, normalize
# Conf strings are spelled by mempool._config, their one writer; re-exported for tune's users.
from mempool._config import to_conf, to_pytorch_conf
from mempool._units import format_bytes
from mempool.tools import replay as _replay

__all__ = ["TuneResult", "tune", "report", "fits", "churn_limit", "DEFAULT_GRID", "to_conf",
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
    rule: str | None = None        # why it ranks below a setting it beats on memory

    @property
    def is_default(self) -> bool:
        return not self.options

    def key(self, order: int):
        """The ranking key (lower ranks first); `order` breaks the last ties by grid order."""
        r = self.result
        return (r.num_ooms, self.churn, r.peak_reserved_bytes,
                r.num_device_alloc + r.num_device_free, len(self.options), order)

    def __str__(self) -> str:
        if self.result is None:
            return f"{self.conf or '(default)'}: skipped ({self.skipped})"
        return f"{self.conf or '(default)'}: {self.result}"


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
    each distinct point once; and the points left out, as (point, reason) pairs: settings
    that do not combine, or where one overrides another by PyTorch's precedence (such a
    point is the same as one without the overridden setting)."""
    keys = list(grid)
    seen = {()}
    out = [{}]
    left_out = []
    for values in itertools.product(*(grid[k] for k in keys)):
        point = {k: v for k, v in zip(keys, values) if v is not None}
        ident = tuple(sorted((k, repr(v)) for k, v in point.items()))
        if ident in seen:
            continue
        seen.add(ident)
        try:
            dropped = _overridden(_checked(point))
        except ValueError as e:
            left_out.append((point, str(e)))
            continue
        if dropped:
            left_out.append((point, "; ".join(dropped.values())))
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
         stream=None, segment_rounding=None) -> list:
    """Replay `events` on sim under every point of `grid`; return the points ranked, best first.

    Parameters
    ----------
    events : Trace, iterable of Event, or mempool.tools.replay.Prepared
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
    segment_rounding : int or str, optional
        The rounding of fixed segments on the device tuned for, so that the default and every
        fixed-segment point replay as they would there: on ``backend="cuda"`` the pool rounds
        them to its ``cudaMemPool``'s unit (32 MiB on an H200, Note [Segment rounding]). None:
        sim's plain segments. It is the device's, not a setting: it never appears in a
        result's conf, applies to no expandable point, and not under a `limit` (where every
        fixed segment is plain).

    Returns
    -------
    list of TuneResult
        Ranked by :meth:`TuneResult.key`: fewest OOMs, then no upstream churn
        (:func:`churn_limit`), then least peak reserved, then fewest upstream calls, then
        fewest changed settings. Points the pool refused (settings that do not combine, or
        expandable segments where they are not available) come last with ``skipped`` set.
        The first entry is the recommendation: the default itself unless a point has fewer
        OOMs, or as many with no churn and no more peak reserved bytes. A churning point that
        reserves less than one ranked above it with as many OOMs carries ``rule``.
    """
    grid = _check_grid(grid)
    if limit is None and grid.get("garbage_collection_threshold") == \
            DEFAULT_GRID["garbage_collection_threshold"]:
        grid["garbage_collection_threshold"] = [None]
    if segment_rounding is not None:
        try:
            segment_rounding = normalize({"segment_rounding": segment_rounding})[
                "segment_rounding"]
        except ValueError as e:
            raise ValueError(f"tune: {e}") from None
    prep = _replay.prepare(events)
    points, left_out = _candidates(grid)
    extra = {} if capacity is None else {"capacity": capacity}
    fixed = dict(extra)
    if segment_rounding is not None and limit is None:
        fixed["segment_rounding"] = segment_rounding
    bar = _Progress(len(points), progress, stream)
    done = []                    # (item, grid order), every replayed point
    # Spelled key by key: to_conf validates the whole point, which these fail.
    skipped = [TuneResult(options=p, conf=",".join(to_conf({k: v}) for k, v in p.items()),
                          pytorch_conf=None, result=None, skipped=why)
               for p, why in left_out]
    unsupported = {}             # option -> reason, once one value of it is refused
    bar_of_churn = None          # churn_limit of the default's calls; the default comes first
    best = None
    for i, point in enumerate(points):
        reason = next((unsupported[k] for k in point if k in unsupported), None)
        result = None
        if reason is None:
            try:
                result = _replay.replay(prep, conf=dict(point), backend="sim", limit=limit,
                                        **(extra if point.get("expandable_segments") else fixed))
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
            if bar_of_churn is None:
                bar_of_churn = churn_limit(_calls(result), result.events)
            item.churn = _calls(result) > bar_of_churn
            done.append((item, i))
            # The same key as the final ranking, so the line's best is the table's rank 1.
            if best is None or item.key(i) < best[0].key(best[1]):
                best = (item, i)
        bar.update(i + 1, _best_text(best[0]) if best else "-")
    ranked = [item for item, _ in sorted(done, key=lambda pair: pair[0].key(pair[1]))]
    for n, item in enumerate(ranked):
        if not item.churn:
            continue
        # Churn is the one rule that ranks a setting below another it beats on OOMs and
        # memory; say so, with the figures.
        beaten = next((r for r in ranked[:n] if not r.churn
                       and r.result.num_ooms == item.result.num_ooms
                       and r.result.peak_reserved_bytes > item.result.peak_reserved_bytes), None)
        if beaten is not None:
            item.rule = (f"upstream churn: {_calls(item.result):,} segment allocations + frees, "
                         f"over the bar of {bar_of_churn:,} (4 x the default's "
                         f"{_calls(_default_of(ranked).result):,}"
                         f" + 1 per 100 events)")
    return ranked + skipped


def _calls(result) -> int:
    """Upstream calls of a replay: segment allocations + frees."""
    return result.num_device_alloc + result.num_device_free


def _default_of(results: list):
    return next((r for r in results if r.is_default), None)


def _best_text(item: TuneResult) -> str:
    r = item.result
    return (f"{item.conf or '(default)'}: {format_bytes(r.peak_reserved_bytes)} peak "
            f"reserved, {_ooms(r.num_ooms)}")


def _ooms(n: int) -> str:
    return f"{n} OOM" if n == 1 else f"{n} OOMs"


_LEGEND = (
    "peak reserved: most memory the pool held from the device (lower is better); "
    "reserved/live: peak reserved over the trace's peak live bytes (1.000 = no overhead, "
    "lower is better); vs default: change of peak reserved; OOMs: allocations refused "
    "(fewer is better, ranked first); upstream: segment allocations + frees, each a "
    "cudaMalloc/cudaFree-class call on a GPU (fewer is better)")


def fits(results: list) -> bool:
    """Whether the best setting replayed the trace without refusing an allocation (under
    the limit, or the device's capacity): only then does :func:`report` recommend one."""
    return any(r.result is not None and r.result.num_ooms == 0 for r in results)


def report(results: list, top: int = 10) -> str:
    """The best `top` results as a text table, the settings ranked down by a rule or
    refused (each with its reason), and the recommendation."""
    import textwrap

    default = _default_of(results)
    ranked = [r for r in results if r.result is not None]
    rank_of = {id(r): n for n, r in enumerate(ranked, 1)}
    lines = [f"{'rank':>4}  {'peak reserved':>13}  {'reserved/live':>13}  {'vs default':>10}  "
             f"{'OOMs':>4}  {'upstream':>8}  settings"]

    def row(r):
        rr = r.result
        vs = (rr.peak_reserved_bytes / default.result.peak_reserved_bytes - 1) * 100 \
            if default and default.result.peak_reserved_bytes else 0.0
        vs = round(vs, 1) + 0.0      # a change that rounds to 0 reads +0.0%, never -0.0%
        calls = f"{_calls(rr):,}{'*' if r.churn else ''}"
        return (f"{rank_of[id(r)]:>4}  {format_bytes(rr.peak_reserved_bytes):>13}  "
                f"{rr.ratio:>13.3f}  {vs:>+9.1f}%  {rr.num_ooms:>4}  {calls:>8}  "
                f"{r.conf or '(default)'}")
    shown = ranked[:top]
    lines += [row(r) for r in shown]
    if default is not None and default not in shown:
        lines.append(row(default))
    lines += textwrap.wrap(_LEGEND, 92)
    if any(r.churn for r in shown):
        lines.append("* upstream churn: far more segment allocations and frees than the "
                     "default (slow on a real GPU); ranked after settings without it")
    ruled = [r for r in ranked if r.rule]
    if ruled:
        # Those that would be the recommendation but for the rule are named, with it (at
        # most five); the rest are counted.
        first = ranked[0].result
        named = [r for r in ruled if (r.result.num_ooms, r.result.peak_reserved_bytes)
                 < (first.num_ooms, first.peak_reserved_bytes)][:5]
        lines.append("")
        lines.append(f"ranked down by a rule: {len(ruled)} settings that reserve less than a "
                     "setting above them with as many OOMs")
        for r in named:
            lines.append(f"  rank {rank_of[id(r)]}: {r.conf} "
                         f"({format_bytes(r.result.peak_reserved_bytes)} peak reserved, "
                         f"{_ooms(r.result.num_ooms)}): {r.rule}")
        others = [r for r in ruled if r not in named]
        if others:
            lines.append(f"  {'and ' if named else ''}{len(others)} {'more ' if named else ''}"
                         f"{'(marked * above) ' if any(r in shown for r in others) else ''}"
                         f"for the same rule, like {others[0].conf} (rank {rank_of[id(others[0])]}): {others[0].rule}")
    refused = [r for r in results if r.result is None]
    if refused:
        by_reason = {}
        for r in refused:
            by_reason.setdefault(r.skipped, []).append(r.conf)
        lines.append("")
        lines.append(f"not replayed: {len(refused)} settings, by reason:")
        for reason, confs in by_reason.items():
            lines.append(f"  {len(confs)} like {confs[0]}: {reason}")
    if ranked and not fits(results):
        lines.append("")
        lines.append(f"no setting fits: every setting replayed refused allocations (the best, "
                     f"{ranked[0].conf or '(default)'}, {_ooms(ranked[0].result.num_ooms)}); "
                     "none is recommended: raise the limit, or shrink the program's peak")
    elif ranked:
        best = ranked[0]
        lines.append("")
        lines.append(f"MEMPOOL_CONF={best.conf}" if best.conf else
                     "MEMPOOL_CONF unset: the defaults are best for this trace")
        if best.conf:
            if best.pytorch_conf:
                lines.append(f"nearest PYTORCH_CUDA_ALLOC_CONF={best.pytorch_conf}")
            else:
                lines.append("PyTorch's allocator has no equivalent of these settings")
    return "\n".join(lines)
