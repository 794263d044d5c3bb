"""Pool options, part three: the table of them, with their defaults, and the checks of a
whole set (:func:`normalize`). Every default is here: the table's, and those the Pool
resolves where the table says None (a simulated device's size, the page of expandable
segments); the Cython layer copies them into the core's config and states none of its own.
``mempool._config`` is the way in.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Mapping, NamedTuple

from mempool._conf_parse import (
    BACKENDS, DEFAULT_MAX_MAP, GiB, MIN_MAX_SPLIT_SIZE, MiB, POOL_HANDLES, ROUNDUP_INTERVALS,
    _mib, _parse_backend, _parse_bool, _parse_capacity, _parse_device, _parse_gc_threshold,
    _parse_limit, _parse_map_ahead, _parse_max_map_size, _parse_max_split_size,
    _parse_min_map_size,
    _parse_nonnegative_size, _parse_optional_bool, _parse_optional_size, _parse_pool_handle,
    _parse_segment_rounding,
    _warn_once, format_bytes, format_size, parse_roundup_divisions)
from mempool._conf_torch import (PYTORCH_KEYS, _PYTORCH_IGNORED, _mb_or_none,
                                 _pytorch_fraction)

# --------------------------------------------------------------------------- the defaults
# Where the table's None means "the backend's own", what the Pool resolves it to.

#: The device's size when `capacity` is None, for the backends with no device to ask.
DEFAULT_CAPACITY = {"sim": 80 * GiB, "host": 4 * GiB}
#: The page of expandable segments on sim and host when `granularity` is None.
DEFAULT_GRANULARITY = 2 * MiB
#: The page of expandable segments on cuda when `granularity` is None: the driver's
#: granularity times the smallest power of two reaching this. The driver's cost follows the
#: number of physical allocations (Note [Expandable pages]); with one per page, on an H200
#: this size made expandable segments cheaper than PyTorch's and as tight as 2 MiB pages on
#: the shipped traces. With one per growth (Note [Growth extents]) the page rounds growths,
#: and on sim it still holds the shipped transformer trace tighter than 2 MiB pages (1.0155
#: against 1.019; docs/expandable.md, "Where the time goes").
DEFAULT_CUDA_PAGE = 8 * MiB


# --------------------------------------------------------------------------- the table


class Option(NamedTuple):
    """One Pool option: its default, type (as accepted), meaning and PyTorch equivalent."""

    default: Any
    kind: str                # what is accepted, in words
    doc: str                 # one line: what it does
    parse: Callable[[Any, str], Any]
    example: str             # a conf-string value, for the docs
    pytorch: str = ""        # nearest PyTorch allocator setting, "" when none
    cuda_only: bool = False  # meaningful only with backend="cuda"
    sized: bool = False      # a byte count: conf strings also take NAME_mb, in MiB


OPTIONS: dict[str, Option] = {
    "backend": Option(
        "cuda", " | ".join(repr(b) for b in BACKENDS),
        "where segments come from: a simulated device, host malloc, or a cudaMemPool",
        _parse_backend, "sim",
        pytorch="`backend` (PyTorch's values `native` and `cudaMallocAsync`: see below)"),
    "device": Option(
        0, "int >= 0", "the device the pool allocates on", _parse_device, "0"),
    "capacity": Option(
        None, "size or None",
        "device memory the pool sees (the simulated device's size; None = the device's own)",
        _parse_capacity, "80GiB", sized=True),
    "roundup_power2_divisions": Option(
        (0,) * ROUNDUP_INTERVALS, "int, '[256:1,>:8]', dict or list of 16",
        "cut each power-of-two size interval into N rounding steps (0 = 512 B rounding)",
        parse_roundup_divisions, "[256:1,512:2,1024:4,>:8]",
        pytorch="`roundup_power2_divisions` (same syntax and meaning)"),
    "max_split_size": Option(
        None, f"size >= {_mib(MIN_MAX_SPLIT_SIZE)} or None",
        "blocks this large or larger are never split (None = split every block)",
        _parse_max_split_size, "64MB", pytorch="`max_split_size_mb` (in MB)", sized=True),
    "cross_stream_reuse": Option(
        True, "bool",
        "serve a stream from another stream's free blocks through an event wait, not a sync",
        _parse_bool, "False"),
    "segment_rounding": Option(
        None, "size or None",
        "once the pool holds more than three of it, every fixed segment is a whole multiple "
        "of this (a small one, for requests up to 1 MiB, exactly one), the first one large "
        "enough that what the pool reserves is whole multiples: fewer, larger segments and "
        "fewer upstream calls; a smaller pool keeps plain segments (None = with "
        "backend='cuda' the unit the cudaMemPool backs allocations with, 32 MiB on an H200, "
        "so the pool reserves what the device holds; else 2 MiB, PyTorch's plain segments); "
        "with max_split_size, only segments that stay below it; under a limit below the "
        "capacity, none (plain segments fit more); not with expandable segments, whose page "
        "rounds each growth (Note [Segment rounding])",
        _parse_segment_rounding, "32MiB", sized=True),
    "release_threshold": Option(
        None, "size or None",
        "cached (free) bytes the pool keeps; beyond it freed segments go upstream, oldest "
        "first (None = keep all); with expandable segments, free pages of streams with no "
        "work left, without a sync (docs/expandable.md); with backend='cuda' also the "
        "cudaMemPool's ReleaseThreshold (None: 0 on a cudaMemPool the pool created, which "
        "then keeps nothing the pool gave back past a sync)",
        _parse_optional_size, "2GB", sized=True),
    "limit": Option(
        None, "size, float in (0, 1], or None",
        "cap on reserved bytes, or that fraction of capacity (None = no cap)",
        _parse_limit, "0.5", pytorch="`per_process_memory_fraction` (fraction form)",
        sized=True),
    "initial_pool_size": Option(
        0, "size",
        "bytes reserved at creation and never released automatically",
        _parse_nonnegative_size, "4GiB", sized=True),
    "garbage_collection_threshold": Option(
        0.0, "float in [0, 1)",
        "above this fraction of limit (or capacity), release idle segments before growing "
        "(0 = off)",
        _parse_gc_threshold, "0.8", pytorch="`garbage_collection_threshold`"),
    "expandable_segments": Option(
        False, "bool",
        "one growing address-space reservation per stream and size class, mapped page by page",
        _parse_bool, "True", pytorch="`expandable_segments`"),
    "granularity": Option(
        None, "size or None",
        f"page size of expandable segments (None = {_mib(DEFAULT_GRANULARITY)} on 'sim' and "
        f"'host', {_mib(DEFAULT_CUDA_PAGE)} on 'cuda', where a page is the driver's allocation "
        "granularity times a power of two)",
        _parse_optional_size, "4MiB", sized=True),
    "max_map_size": Option(
        None, "size or None",
        "the most bytes one physical allocation of expandable segments holds: a growth maps "
        "one allocation per this many bytes (whole pages, at least one) and releases each "
        f"only whole (None = {_mib(DEFAULT_MAX_MAP)}, or one page when a limit is set; the "
        "page size = one "
        "allocation per page)",
        _parse_max_map_size, "256MiB", sized=True),
    "min_map_size": Option(
        None, "size or None",
        "the least bytes a growth of expandable segments at the end of a range maps (whole "
        "pages, one physical allocation): fewer, larger driver allocations for a little more "
        "mapped at the peak; holes are still filled to the page, a pool with a limit "
        "ignores it, and it never takes a pool past garbage_collection_threshold (None = "
        "what the request needs)",
        _parse_min_map_size, "64MiB", sized=True),
    "map_ahead": Option(
        None, "size or None",
        "expandable segments: a thread of the pool keeps this many free bytes mapped at the "
        "end of each growing range, ahead of its growth, and does the release_threshold's "
        "unmapping behind it, so that allocations and frees make fewer driver calls; the "
        "stock counts as reserved and never passes limit, garbage_collection_threshold or "
        "release_threshold (None = no thread; Note [Mapper])",
        _parse_map_ahead, "64MiB", sized=True),
    "graph_capture_record_stream_reuse": Option(
        False, "bool",
        "during a CUDA graph capture, a block freed with recorded streams (record_stream) is "
        "reused within the capture once the capture's own order puts every use before the "
        "request, instead of waiting for the capture's end (Note [Capture reuse])",
        _parse_bool, "True", pytorch="`graph_capture_record_stream_reuse`"),
    "ipc": Option(
        None, "bool or None",
        "blocks may be shared with other processes (Pool.export; docs/sharing.md, \"Other "
        "processes\"): None = on for 'sim', on for 'cuda' with pool_handle='create' where the "
        "device has POSIX-fd pool handles, off for 'host' (True backs host memory with memfds)",
        _parse_optional_bool, "False"),
    "pool_handle": Option(
        "create", ", ".join(repr(h) for h in POOL_HANDLES) + " or int",
        "which cudaMemPool supplies segments: a new one, the device's default or current "
        "pool, or a given cudaMemPool_t handle",
        _parse_pool_handle, "default", cuda_only=True),
    "reuse_follow_event_dependencies": Option(
        True, "bool", "cudaMemPoolReuseFollowEventDependencies on the cudaMemPool",
        _parse_bool, "False", cuda_only=True),
    "reuse_allow_opportunistic": Option(
        True, "bool", "cudaMemPoolReuseAllowOpportunistic on the cudaMemPool",
        _parse_bool, "False", cuda_only=True),
    "reuse_allow_internal_dependencies": Option(
        True, "bool", "cudaMemPoolReuseAllowInternalDependencies on the cudaMemPool",
        _parse_bool, "False", cuda_only=True),
}


def _default(name: str) -> Any:
    d = OPTIONS[name].default
    return list(d) if isinstance(d, tuple) else d


def _accepted_keys() -> str:
    return ", ".join(OPTIONS)


# Conf-string spellings beside the canonical names: conf key -> (our key, reader of the conf
# value). Keywords take the canonical names only: one spelling per option in the Python API
# and in everything written out (to_conf).
# Every size option NAME is also NAME_mb (whole MiB, as PyTorch reads max_split_size_mb),
# and PyTorch's per_process_memory_fraction is limit's fraction form.
_ALIASES: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    f"{name}_mb": (name, _mb_or_none) for name, opt in OPTIONS.items() if opt.sized}
_ALIASES["per_process_memory_fraction"] = ("limit", _pytorch_fraction)


def _unknown_key(key: Any, source: str) -> ValueError:
    hint = ""
    if key in _ALIASES:
        target = _ALIASES[key][0]
        hint = (f" ({key!r} is a conf-string spelling; as a keyword write {target!r}, "
                f"with a size such as '2048MiB')")
    elif key in _PYTORCH_IGNORED:
        hint = (f" ({key!r} is a PyTorch allocator key with no meaning here: "
                f"{_PYTORCH_IGNORED[key]})")
    elif isinstance(key, str):
        known = list(OPTIONS) + list(_ALIASES) + list(PYTORCH_KEYS)
        close = difflib.get_close_matches(key, known, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    return ValueError(f"{source}: unknown option {key!r}{hint}; accepted options: "
                      f"{_accepted_keys()} (conf strings also take NAME_mb for each size "
                      "option, and PyTorch's allocator keys)")


# --------------------------------------------------------------------------- normalize


def normalize(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate options and fill in defaults.

    Parameters
    ----------
    options : mapping
        Option name -> value, as given to ``Pool(**options)`` (raw strings such as
        ``"2GB"`` are fine) or as returned by :func:`parse_conf`.

    Returns
    -------
    dict
        Every option of :data:`OPTIONS`, in table order, with parsed values: sizes as int
        bytes, ``limit`` as int bytes or a float fraction (the Pool resolves a fraction
        against capacity), ``roundup_power2_divisions`` as a list of 16 ints.

    Raises
    ------
    ValueError
        For an unknown key (the message lists the accepted ones), a bad value (naming key,
        value and what is accepted), or options that contradict each other where PyTorch
        has no rule (between mempool's own options).

    Notes
    -----
    Where PyTorch lets one setting win over another (``expandable_segments`` over
    ``max_split_size``), the loser is set back to its default with a one-time
    :class:`ConfigWarning` (see :func:`overridden`).
    """
    out = _checked(options)
    for name, why in _overridden(out).items():
        _warn_once(("overridden", name), why)
        out[name] = _default(name)
    rounding, limit, capacity = out["segment_rounding"], out["limit"], out.get("capacity")
    # A limit of the whole device limits nothing, and the core rounds under it: a fraction of
    # 1.0, or bytes at least the capacity where the options give it (on cuda the device's
    # capacity is known only once the pool is made, and a byte limit still warns).
    whole_device = (isinstance(limit, float) and limit == 1.0) or (
        isinstance(limit, int) and isinstance(capacity, int) and limit >= capacity)
    if rounding is not None and rounding > 2 << 20 and limit is not None and not whole_device:
        # Kept, not overridden: it applies again once set_limit(None) lifts the limit.
        _warn_once(("rounding under a limit",),
                   f"option 'segment_rounding' ({format_size(rounding)}) has no effect while "
                   f"'limit' is set: under a limit every fixed segment is plain, since a "
                   f"rounded segment's tail would count against the limit and refuse requests "
                   f"plain segments fit (Note [Segment rounding]); it applies again after "
                   f"set_limit(None)")
    if out["map_ahead"] is not None and not out["expandable_segments"]:
        # Kept, as the rounding above: the core reads it on expandable pools only.
        _warn_once(("map_ahead without expandable segments",),
                   f"option 'map_ahead' ({format_size(out['map_ahead'])}) is ignored: it "
                   "applies to expandable segments only (set 'expandable_segments'), fixed "
                   "segments have no range to map ahead of")
    return out


def overridden(options: Mapping[str, Any]) -> list[str]:
    """The options of `options` that others override, by PyTorch's precedence.

    :func:`normalize` sets them back to their defaults with a :class:`ConfigWarning`; this
    says which, without a warning (for a search over settings that skips such points).
    Raises as :func:`normalize` does.
    """
    return list(_overridden(_checked(options)))


def _checked(options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option parsed, defaults filled in, the contradictions that are errors raised."""
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of option name to value, "
                        f"got {type(options).__name__}")
    for key in options:
        if key not in OPTIONS:
            raise _unknown_key(key, "Pool options")
    out = {}
    for name, opt in OPTIONS.items():
        out[name] = opt.parse(options[name], name) if name in options else _default(name)
    _check_combination(out, options)
    return out


def applied_max_split(max_split_size: int | None, expandable_segments: Any) -> int | None:
    """`max_split_size` as a pool applies it: None (no limit) on expandable segments.

    PyTorch takes both and lets expandable segments win: its should_split ignores
    max_split_size when they are on. Ours grow in place and never split-limit.
    """
    return None if expandable_segments else max_split_size


def _overridden(out: dict[str, Any]) -> dict[str, str]:
    """Option -> why another setting overrides it, in parsed options."""
    if applied_max_split(out["max_split_size"], out["expandable_segments"]) != \
            out["max_split_size"]:
        return {"max_split_size": (
            f"options 'expandable_segments' and 'max_split_size' "
            f"({format_size(out['max_split_size'])}) do not combine: as in PyTorch, "
            "expandable segments win and max_split_size is ignored (expandable segments "
            "grow in place and are never split-limited)")}
    return {}


def _check_combination(out: dict[str, Any], given: Mapping[str, Any]) -> None:
    if out["expandable_segments"] and out["segment_rounding"] is not None:
        raise ValueError(
            f"option 'segment_rounding' ({format_size(out['segment_rounding'])}) rounds fixed "
            "segments and does not combine with 'expandable_segments', whose page rounds "
            "each growth: leave it out, or set 'granularity' for the page")
    if out["backend"] != "cuda":
        for name, opt in OPTIONS.items():
            if opt.cuda_only and name in given and out[name] != _default(name):
                raise ValueError(
                    f"option {name!r} ({out[name]!r}) applies only to backend='cuda', "
                    f"not {out['backend']!r}")
    capacity, limit, initial = out["capacity"], out["limit"], out["initial_pool_size"]
    if capacity is not None and initial > capacity:
        raise ValueError(f"option 'initial_pool_size' ({format_bytes(initial, exact=True)}) "
                         f"exceeds 'capacity' ({format_bytes(capacity, exact=True)})")
    if limit is not None:
        cap_bytes = limit if isinstance(limit, int) else (
            None if capacity is None else math.floor(limit * capacity))
        if cap_bytes is not None and initial > cap_bytes:
            raise ValueError(f"option 'initial_pool_size' ({format_bytes(initial, exact=True)}) "
                             f"exceeds 'limit' ({format_bytes(cap_bytes, exact=True)}"
                             + ("" if isinstance(limit, int) else f", {limit!r} of 'capacity'")
                             + ")")
