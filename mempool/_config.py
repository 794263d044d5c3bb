"""Pool options: the one table of them, and their parsing and validation.

Pure Python with no use of the compiled core, so configuration errors surface (and are
tested) without a build. Three ways in, one set of rules:

- keywords: ``Pool(release_threshold="2GB", ...)`` -> :func:`normalize`;
- a conf string in PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax:
  ``Pool.from_conf("release_threshold:2GB,max_split_size_mb:64")`` -> :func:`parse_conf`;
- the ``MEMPOOL_CONF`` environment variable -> :func:`conf_from_env`.

Every bad value, and every key neither ours nor PyTorch's, is a ``ValueError`` that names
the key, the value, and what is accepted. A conf string is read the way PyTorch reads its
own (so strings copied from PyTorch guides work): the ``_mb`` spelling of every size option
is accepted; a PyTorch allocator key that has no meaning for the pool is accepted with a
one-time :class:`ConfigWarning` that says so; where settings contradict each other, PyTorch's
precedence decides, with a one-time warning. Nothing is ignored silently. Keywords
(``Pool(...)``) know the canonical names only.
"""
from __future__ import annotations

import difflib
import math
import numbers
import operator
import os
import re
import sys
import warnings
from fractions import Fraction
from typing import Any, Callable, Mapping, NamedTuple

# The size policy is the C core's, read from the extension (mempool/_policy.pxi): this
# module is imported while the extension initialises, after it has set these names.
from mempool._core import (LARGE_ROUND, LARGE_SEGMENT, LARGE_BUFFER, MAX_ALLOC,
                           MIN_LARGE_ALLOC, ROUNDUP_INTERVALS, SMALL_SEGMENT, SMALL_SIZE)
from mempool._units import format_bytes

__all__ = [
    "OPTIONS", "Option", "ConfigWarning", "PYTORCH_KEYS", "PYTORCH_HOST_KEYS", "parse_size",
    "parse_roundup_divisions", "normalize", "overridden", "parse_conf", "conf_from_env",
    "to_conf", "canonical_conf", "split_pytorch_conf", "to_pytorch_conf", "format_size",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# PyTorch refuses max_split_size_mb below kLargeBuffer (20 MiB) and so do we, for the same
# reason: requests of 1-10 MiB are served from 20 MiB segments (LARGE_SEGMENT), and a
# max_split_size below that would make every such segment unsplittable, one segment per request.
MIN_MAX_SPLIT_SIZE = LARGE_SEGMENT


def _mib(nbytes: int) -> str:
    """A size of the policy, all whole MiB, as the messages below spell it: ``20 MiB``."""
    return f"{nbytes // MiB} MiB"

BACKENDS = ("sim", "host", "cuda")
POOL_HANDLES = ("create", "default", "current")

# Units are powers of 1024 whether spelled KB or KiB, as PyTorch reads its *_mb keys.
_UNITS = {
    "": 1, "b": 1,
    "kb": KiB, "kib": KiB,
    "mb": MiB, "mib": MiB,
    "gb": GiB, "gib": GiB,
    "tb": TiB, "tib": TiB,
}
# re.ASCII: \d would otherwise take any Unicode digit ("１", a full-width one) as a number.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$", re.ASCII)
_FRACTION_RE = re.compile(r"^\s*(\d*\.\d*)\s*$", re.ASCII)
_NONE_WORDS = ("none", "unlimited")
_TRUE_WORDS = ("true", "1")
_FALSE_WORDS = ("false", "0")

_SIZE_ACCEPTED = ("an int >= 0 (bytes) or a string such as '512', '4KB', '512MiB', "
                  "'1.5GB' (KB/MB/GB/TB and KiB/MiB/GiB/TiB are all powers of 1024), "
                  "below 2**64")
# Sizes are size_t in the core. The largest one, 2**64 - 1, is the core's "no limit", so
# options whose None means unlimited stop one below it (a limit of 2**64 - 1 bytes would
# silently be no limit at all).
SIZE_END = 2 ** 64
UNLIMITED_END = 2 ** 64 - 1
# A device ordinal is a C int.
DEVICE_END = 2 ** 31


class OptionError(ValueError):
    """A pool option's value that is not valid: the message names the option, the value and
    what is accepted. A ValueError, so code that catches that keeps working; `why` keeps the
    reason alone, so that a wrapper (a conf string's parser) can restate it."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why

    def __reduce__(self):
        # Pickled whole (a Dask or multiprocessing worker's error crosses processes).
        return (type(self), (str(self), self.why))


def _error(key: str, value: Any, accepted: str, why: str = "") -> OptionError:
    shown = f" ({why})" if why else ""
    return OptionError(f"option {key!r}: {value!r} is not valid{shown}; accepted: {accepted}", why)


class ConfigWarning(UserWarning):
    """A conf-string setting the pool accepts but does not apply: a PyTorch allocator key
    with no meaning for the pool, or a setting that another one overrides."""


# Topics already warned about (a key, a pair of options): each is warned once per process,
# however many pools read the same string (default_pool reads MEMPOOL_CONF once per device).
# Guarded by the GIL; a race between threads costs at most one extra warning.
_warned: set = set()


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_once(topic: Any, message: str) -> None:
    if topic in _warned:
        return
    _warned.add(topic)
    # Point the warning at the first caller outside mempool: the line that built the pool.
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ConfigWarning, stacklevel=level)


# --------------------------------------------------------------------------- value parsers


def _ascii_digits(text: str) -> bool:
    """True for a non-empty run of ASCII digits: str.isdigit() also takes "１" or "²"."""
    return text.isascii() and text.isdigit()


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def parse_size(value: Any, key: str = "size") -> int:
    """Parse a byte count.

    Parameters
    ----------
    value : int or str
        An int >= 0, or a string: a number with an optional unit, ``"512"``, ``"512B"``,
        ``"4KB"``, ``"512MB"``, ``"2GiB"``, ``"1.5GB"``, ``"64mb"``. KB/MB/GB/TB are powers
        of 1024, as in PyTorch's allocator settings, and so are KiB/MiB/GiB/TiB; units are
        case-insensitive. A fractional count rounds down to whole bytes, but a fraction of a
        byte with no unit (``"1.5"``) is refused.
    key : str
        The option being parsed, named in the error message.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        For a bool, a float, a negative number, a size of 2**64 bytes or more, or a string
        that is not a size.
    """
    n = _parse_size_unbounded(value, key)
    if n >= SIZE_END:
        raise _error(key, value, _SIZE_ACCEPTED, "out of range: sizes must be below 2**64")
    return n


def _parse_size_unbounded(value: Any, key: str) -> int:
    if _is_int(value):
        n = operator.index(value)
        if n < 0:
            raise _error(key, value, _SIZE_ACCEPTED, "negative")
        return n
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            # "-1" is refused for its sign, as the int -1 is: one reason for both spellings.
            if value.strip().startswith("-") and _SIZE_RE.match(value.strip()[1:]):
                raise _error(key, value, _SIZE_ACCEPTED, "negative")
            raise _error(key, value, _SIZE_ACCEPTED, "not a number with an optional unit")
        number, unit = m.group(1), m.group(2).lower()
        if unit not in _UNITS:
            raise _error(key, value, _SIZE_ACCEPTED, f"unknown unit {m.group(2)!r}")
        exact = Fraction(number) * _UNITS[unit]
        if _UNITS[unit] == 1 and exact.denominator != 1:
            raise _error(key, value, _SIZE_ACCEPTED, "a fraction of a byte")
        return math.floor(exact)
    if isinstance(value, float):
        raise _error(key, value, _SIZE_ACCEPTED,
                     "a float is not a size; write an int or a string such as '1.5GiB'")
    raise _error(key, value, _SIZE_ACCEPTED, f"a {type(value).__name__}")


def _is_none_word(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS)


def _size_or_none(value: Any, key: str, accepted: str) -> int | None:
    """None for the none-words, else a size below 2**64 - 1 (the core's "unlimited"); a bad
    value's error names `accepted`."""
    if _is_none_word(value):
        return None
    try:
        n = parse_size(value, key)
    except OptionError as e:
        raise _error(key, value, accepted, e.why) from None
    if n >= UNLIMITED_END:
        raise _error(key, value, accepted,
                     "out of range: 2**64 - 1 and above are not sizes; write None for no limit")
    return n


def _parse_optional_size(value: Any, key: str) -> int | None:
    return _size_or_none(value, key, _SIZE_ACCEPTED + ", or None / 'none' / 'unlimited'")


def _parse_segment_rounding(value: Any, key: str) -> int | None:
    accepted = ("a multiple of 2 MiB, at most 1 TiB: an int (bytes) or a string such as "
                "'32MiB' ('2MiB': plain segments, as PyTorch's); or None / 'none' (the "
                "default: the unit of the cudaMemPool with backend='cuda', else plain)")
    n = _size_or_none(value, key, accepted)
    if n is not None and (n == 0 or n % (2 * MiB) or n > (1 << 40)):
        raise _error(key, value, accepted,
                     f"{format_bytes(n, exact=True)} is not a multiple of 2 MiB between 2 MiB "
                     "and 1 TiB")
    return n


def _parse_max_map_size(value: Any, key: str) -> int | None:
    accepted = ("a size above 0: an int (bytes) or a string such as '256MiB'; or None / "
                "'none' (the default: 1 GiB, one page under a limit)")
    n = _size_or_none(value, key, accepted)
    if n == 0:
        raise _error(key, value, accepted, "a growth must map at least one page per allocation")
    return n


def _parse_min_map_size(value: Any, key: str) -> int | None:
    accepted = ("a size: an int (bytes) or a string such as '64MiB'; or None / 'none' / 0 "
                "(the default: a growth maps what its request needs)")
    n = _size_or_none(value, key, accepted)
    return n or None


def _parse_max_split_size(value: Any, key: str) -> int | None:
    accepted = (f"a size of at least {_mib(MIN_MAX_SPLIT_SIZE)}, or None / 'none' / "
                "'unlimited' (split every block)")
    n = _size_or_none(value, key, accepted)
    if n is not None and n < MIN_MAX_SPLIT_SIZE:
        raise _error(key, value, accepted,
                     f"{format_bytes(n, exact=True)} is below {format_bytes(MIN_MAX_SPLIT_SIZE)}: "
                     f"{SMALL_SIZE // MiB}-{_mib(MIN_LARGE_ALLOC)} requests take "
                     f"{_mib(LARGE_SEGMENT)} segments, which such a limit would make unsplittable")
    return n


def _parse_nonnegative_size(value: Any, key: str) -> int:
    n = parse_size(value, key)
    if n > MAX_ALLOC:
        # The core rounds the reservation up to a segment or a page: 2**64 - 1 wrapped round
        # to 0 bytes, a pool made without its initial reservation and without a word.
        raise _error(key, value, _SIZE_ACCEPTED,
                     f"out of range: at most 2**{MAX_ALLOC.bit_length() - 1} bytes, the "
                     f"largest request served")
    return n


def _parse_capacity(value: Any, key: str) -> int | None:
    accepted = "a size > 0, or None for the device's own"
    n = _size_or_none(value, key, accepted)
    if n == 0:
        raise _error(key, value, accepted, "zero")
    return n


def _parse_limit(value: Any, key: str) -> int | float | None:
    accepted = ("a size in bytes (an int, or a string such as '8GiB'), a float fraction of "
                "capacity in (0, 1] such as 0.5 or '0.5', or None / 'none' / 'unlimited'")
    if _is_none_word(value):
        return None
    fraction = None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        fraction = float(value)
    elif isinstance(value, str) and _FRACTION_RE.match(value) and value.strip() != ".":
        fraction = float(value)
    if fraction is not None:
        if not 0.0 < fraction <= 1.0:
            raise _error(key, value, accepted,
                         "a fraction must lie in (0, 1]; write a byte limit as an int or "
                         "with a unit")
        return fraction
    n = _size_or_none(value, key, accepted)
    if n is not None and n < SMALL_SEGMENT:
        # The smallest segment the pool reserves: under a lower limit no allocation fits.
        raise _error(key, value, accepted,
                     f"below {format_bytes(SMALL_SEGMENT)}, the smallest segment the pool "
                     "reserves, so no allocation could succeed")
    return n


def _parse_bool(value: Any, key: str) -> bool:
    accepted = "True/False, or a string 'true'/'false'/'True'/'False'/'1'/'0'"
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise _error(key, value, accepted)


def _parse_gc_threshold(value: Any, key: str) -> float:
    accepted = "a float in [0, 1): the fraction of limit (or capacity) above which idle " \
               "segments are released before growing; 0 = off"
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise _error(key, value, accepted)
    if isinstance(value, str) and not value.isascii():
        raise _error(key, value, accepted, "not an ASCII number")
    try:
        v = float(value.strip() if isinstance(value, str) else value)
    except ValueError:
        raise _error(key, value, accepted) from None
    if not 0.0 <= v < 1.0:
        raise _error(key, value, accepted, "out of range")
    return v


def _parse_backend(value: Any, key: str) -> str:
    accepted = "'sim', 'host' or 'cuda'"
    if isinstance(value, str):
        name = value.strip()
        if name in BACKENDS:
            return name
        if name in ("native", "cudaMallocAsync", "hipMallocAsync"):
            raise ValueError(
                f"option {key!r}: {value!r} selects one of PyTorch's own allocators and has "
                f"no meaning here; accepted: {accepted} ('cuda' already draws its segments "
                "from a cudaMemPool through cudaMallocFromPoolAsync)")
    raise _error(key, value, accepted)


def _parse_device(value: Any, key: str) -> int:
    accepted = "an int >= 0 and below 2**31 (or a string of ASCII digits)"
    if isinstance(value, str) and _ascii_digits(value.strip()):
        n = int(value.strip())
    elif _is_int(value) and operator.index(value) >= 0:
        n = operator.index(value)
    else:
        raise _error(key, value, accepted)
    if n >= DEVICE_END:
        raise _error(key, value, accepted, "out of range: a device ordinal is a C int")
    return n


def _parse_pool_handle(value: Any, key: str) -> str | int:
    accepted = ("'create' (a pool of its own), 'default' (the device's default pool), "
                "'current' (the device's current pool), or a cudaMemPool_t handle as an "
                "int > 0 and below 2**64")
    if isinstance(value, str):
        word = value.strip()
        if word in POOL_HANDLES:
            return word
        if not word.isascii():
            raise _error(key, value, accepted, "not an ASCII number")
        try:
            value = int(word, 0)
        except ValueError:
            raise _error(key, value, accepted) from None
    if _is_int(value) and 0 < operator.index(value) < SIZE_END:
        return operator.index(value)
    raise _error(key, value, accepted)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


_ROUNDUP_ACCEPTED = (
    "an int 0 or a power of two (every interval), a PyTorch list such as "
    "'[256:1,512:2,1024:4,>:8]' (keys: interval starts in MB, powers of two, or '>' for "
    "the rest; values: 0 or powers of two), a dict {256: 1, '>': 8}, or a list of 16 ints")


# The core compares a request with 512 B x the division count: past 2**53 that product
# would not fit a size_t, and steps that small round nothing anyway.
MAX_ROUNDUP_DIVISIONS = 2 ** 53


def _roundup_value(v: Any, key: str, whole: Any) -> int:
    if isinstance(v, str) and _ascii_digits(v.strip()):
        v = int(v.strip())
    if not _is_int(v) or not (operator.index(v) == 0 or _is_pow2(operator.index(v))):
        raise _error(key, whole, _ROUNDUP_ACCEPTED, f"division count {v!r} is not 0 or a power of two")
    if operator.index(v) > MAX_ROUNDUP_DIVISIONS:
        raise _error(key, whole, _ROUNDUP_ACCEPTED,
                     f"division count {v!r} is out of range (at most 2**53)")
    return operator.index(v)


def _roundup_from_pairs(pairs: list, key: str, whole: Any) -> list[int]:
    # Exactly PyTorch's AcceleratorAllocatorConfig::parseRoundUpPower2Divisions
    # (c10/core/AllocatorConfig.cpp, torch 2.9+; checked against torch 2.13's libc10):
    # - interval i is [2**i, 2**(i+1)) MiB, i = 0..15 (index 0 also takes all below 1 MiB,
    #   index 15 all at or above 32 GiB); a key K (MB, a power of two) sets index
    #   log2(K) clamped to 0..15;
    # - the first numeric key also fills every index below its own;
    # - '>' fills from the index after the last numeric key to the end (from index 1 when
    #   no numeric key came before it, so index 0 keeps its value);
    # - indices no entry reaches stay 0 (plain 512 B rounding); a later entry overrides.
    # (PyTorch before the AcceleratorAllocatorConfig rewrite filled '>' from the last key's
    # own index, overwriting it; torch 2.11 and 2.13 behave as here.)
    divs = [0] * ROUNDUP_INTERVALS
    first = True
    last_index = 0
    for k, v in pairs:
        value = _roundup_value(v, key, whole)
        if isinstance(k, str) and k.strip() == ">":
            for i in range(last_index + 1, ROUNDUP_INTERVALS):
                divs[i] = value
            continue
        if isinstance(k, str) and _ascii_digits(k.strip()):
            k = int(k.strip())
        if not _is_int(k) or not _is_pow2(operator.index(k)):
            raise _error(key, whole, _ROUNDUP_ACCEPTED,
                         f"interval key {k!r} is not '>' or a power of two (MB)")
        index = min(operator.index(k).bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            for i in range(index):
                divs[i] = value
            first = False
        divs[index] = value
        last_index = index
    return divs


def parse_roundup_divisions(value: Any, key: str = "roundup_power2_divisions") -> list[int]:
    """Parse ``roundup_power2_divisions`` into one division count per size interval.

    Interval ``i`` (0..15) holds sizes in ``[2**i, 2**(i+1))`` MiB; index 0 also holds all
    smaller sizes and index 15 all larger ones. A count N > 1 rounds a request up to the
    next of N equal steps of its power-of-two interval; 0 or 1 keeps plain 512 B rounding.

    Parameters
    ----------
    value : int, str, dict or list
        - an int (0 or a power of two): the same count for every interval. PyTorch's scalar
          form refuses 0; here 0 means off, like the default;
        - a string: an int as above, or PyTorch's list ``"[256:1,512:2,1024:4,>:8]"``;
        - a dict ``{256: 1, 512: 2, ">": 8}``, read in insertion order like the list;
        - a list or tuple of 16 ints, taken as is.
        The list and dict forms follow PyTorch's rules exactly (see the comment in
        ``_roundup_from_pairs``).
    key : str
        The option being parsed, named in the error message.

    Returns
    -------
    list of int
        16 division counts.
    """
    if isinstance(value, bool):
        raise _error(key, value, _ROUNDUP_ACCEPTED)
    if _is_int(value):
        return [_roundup_value(value, key, value)] * ROUNDUP_INTERVALS
    if isinstance(value, str):
        text = re.sub(r"\s+", "", value)
        if _ascii_digits(text):
            return [_roundup_value(int(text), key, value)] * ROUNDUP_INTERVALS
        if not (text.startswith("[") and text.endswith("]")):
            raise _error(key, value, _ROUNDUP_ACCEPTED)
        body = text[1:-1]
        pairs = []
        if body:
            for item in body.split(","):
                parts = item.split(":")
                if len(parts) != 2 or not parts[0] or not parts[1]:
                    raise _error(key, value, _ROUNDUP_ACCEPTED,
                                 f"entry {item!r} is not KEY:VALUE")
                pairs.append((parts[0], parts[1]))
        return _roundup_from_pairs(pairs, key, value)
    if isinstance(value, Mapping):
        return _roundup_from_pairs(list(value.items()), key, value)
    if isinstance(value, (list, tuple)):
        if len(value) != ROUNDUP_INTERVALS:
            raise _error(key, value, _ROUNDUP_ACCEPTED,
                         f"a list needs exactly {ROUNDUP_INTERVALS} entries, got {len(value)}")
        return [_roundup_value(v, key, value) for v in value]
    raise _error(key, value, _ROUNDUP_ACCEPTED, f"a {type(value).__name__}")


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
        "cuda", "'sim' | 'host' | 'cuda'",
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
        None, "size >= 20 MiB or None",
        "blocks this large or larger are never split (None = split every block)",
        _parse_max_split_size, "64MB", pytorch="`max_split_size_mb` (in MB)", sized=True),
    "cross_stream_reuse": Option(
        True, "bool",
        "serve a stream from another stream's free blocks through an event wait, not a sync",
        _parse_bool, "False"),
    "segment_rounding": Option(
        None, "size or None",
        "every fixed segment is a whole multiple of this (a small one, for requests up to "
        "1 MiB, exactly one): fewer, larger segments and fewer upstream calls (None = with "
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
        "page size of expandable segments (None = 2 MiB on 'sim' and 'host', 8 MiB on "
        "'cuda', where a page is the driver's allocation granularity times a power of two)",
        _parse_optional_size, "4MiB", sized=True),
    "max_map_size": Option(
        None, "size or None",
        "the most bytes one physical allocation of expandable segments holds: a growth maps "
        "one allocation per this many bytes (whole pages, at least one) and releases each "
        "only whole (None = 1 GiB, or one page when a limit is set; the page size = one "
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
    "graph_capture_record_stream_reuse": Option(
        False, "bool",
        "during a CUDA graph capture, a block freed with recorded streams (record_stream) is "
        "reused within the capture once the capture's own order puts every use before the "
        "request, instead of waiting for the capture's end (Note [Capture reuse])",
        _parse_bool, "True", pytorch="`graph_capture_record_stream_reuse`"),
    "pool_handle": Option(
        "create", "'create', 'default', 'current' or int",
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


# --------------------------------------------------------------------------- PyTorch keys

# Conf-string spellings beside the canonical names: conf key -> (our key, reader of the conf
# value). Keywords take the canonical names only: one spelling per option in the Python API
# and in everything written out (to_conf).
def _mb_to_bytes(value: Any, key: str) -> int:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and _ascii_digits(text):
        return int(text) * MiB
    if _is_int(text) and operator.index(text) >= 0:
        return operator.index(text) * MiB
    raise _error(key, value, "a whole number of MB (MB = 2**20 bytes), as in PyTorch")


def _mb_or_none(value: Any, key: str) -> int | None:
    # The none-words pass through: the option's own parser accepts or refuses None.
    return None if _is_none_word(value) else _mb_to_bytes(value, key)


def _pytorch_fraction(value: Any, key: str) -> float:
    accepted = "a fraction of device memory in (0, 1]"
    if isinstance(value, str) and not value.isascii():
        raise _error(key, value, accepted, "not an ASCII number")
    try:
        v = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise _error(key, value, accepted) from None
    if isinstance(value, bool) or not 0.0 < v <= 1.0:
        raise _error(key, value, accepted)
    return v


# Every size option NAME is also NAME_mb (whole MiB, as PyTorch reads max_split_size_mb),
# and PyTorch's per_process_memory_fraction is limit's fraction form.
_ALIASES: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    f"{name}_mb": (name, _mb_or_none) for name, opt in OPTIONS.items() if opt.sized}
_ALIASES["per_process_memory_fraction"] = ("limit", _pytorch_fraction)

_NO_PINNED = "it configures PyTorch's pinned host-memory allocator, which stays PyTorch's " \
             "when the pool serves CUDA tensors"
_NO_LOCK = "it concerns PyTorch's allocator lock; the pool's lock rules are fixed " \
           "(see docs/architecture.md)"

# Every other key of PyTorch's allocator config (torch 2.13: AcceleratorAllocatorConfig and
# CUDAAllocatorConfig; 2.11 has a subset), with the reason it has no meaning for the pool.
# A conf string may hold them (a warning says they are ignored); keywords may not.
_PYTORCH_IGNORED: dict[str, str] = {
    "large_segment_size_mb": f"segment sizes are fixed here: {_mib(SMALL_SEGMENT)} for requests "
                             f"up to {_mib(SMALL_SIZE)}, {_mib(LARGE_SEGMENT)} for requests under "
                             f"{_mib(MIN_LARGE_ALLOC)}, larger ones rounded to {_mib(LARGE_ROUND)}",
    "max_non_split_rounding_mb": f"an unsplit (oversize) block serves requests up to "
                                 f"{_mib(LARGE_BUFFER)} smaller than itself; the slack is fixed",
    "release_lock_on_cudamalloc": _NO_LOCK,
    "release_lock_on_hipmalloc": _NO_LOCK,
    "pinned_use_cuda_host_register": _NO_PINNED,
    "pinned_use_hip_host_register": _NO_PINNED,
    "pinned_num_register_threads": _NO_PINNED,
    "pinned_use_background_threads": _NO_PINNED,
    "pinned_max_round_threshold_mb": _NO_PINNED,
    "pinned_max_cached_size_mb": _NO_PINNED,
    "pinned_reserve_segment_size_mb": _NO_PINNED,
    "pinned_free_catch_all": _NO_PINNED,
    "throw_on_cudamalloc_oom": "the pool's limit always refuses a request before the driver "
                               "is asked, with an out-of-memory error (and PyTorch's OOM "
                               "rejection observers hear of it); there is nothing to switch on",
}

def pytorch_key_ignored_because(key: str) -> str:
    """Why PyTorch's allocator key `key` has no meaning for the pool, in words."""
    if key == "backend":
        return "it picks one of PyTorch's own allocators, and the pool took their place"
    return _PYTORCH_IGNORED.get(key, "the pool has no such option")


# PyTorch's values of its `backend` key: which of its own allocators serves CUDA tensors.
# Ours means where the pool's segments come from; see _read_entry.
_PYTORCH_BACKENDS = ("native", "cudaMallocAsync", "hipMallocAsync")
# What PyTorch's cudaMallocAsync backend ignores (it has no cache to tune); given with
# backend:cudaMallocAsync, the pool ignores them too, as PyTorch would.
_CACHE_OPTIONS = ("max_split_size", "roundup_power2_divisions", "garbage_collection_threshold",
                  "expandable_segments")

# Every key PyTorch's allocator config accepts (torch 2.13).
PYTORCH_KEYS = frozenset(
    ("backend", "max_split_size_mb", "per_process_memory_fraction", "roundup_power2_divisions",
     "garbage_collection_threshold", "expandable_segments", "graph_capture_record_stream_reuse")
    + tuple(_PYTORCH_IGNORED))
# The keys PyTorch still applies when the pool is its CUDA allocator: those of its pinned
# host-memory allocator, which stays PyTorch's.
PYTORCH_HOST_KEYS = frozenset(k for k in _PYTORCH_IGNORED if k.startswith("pinned_"))


def _alias_example(alias: str) -> str:
    """A conf value for `alias`, for the docs: the option's example in MB where it is one."""
    target, _ = _ALIASES[alias]
    if alias == "per_process_memory_fraction":
        return "0.5"
    try:
        n = parse_size(OPTIONS[target].example)
    except ValueError:
        n = 0
    return str(n // MiB) if n and n % MiB == 0 else "1024"


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


def _overridden(out: dict[str, Any]) -> dict[str, str]:
    """Option -> why another setting overrides it, in parsed options."""
    if out["expandable_segments"] and out["max_split_size"] is not None:
        # PyTorch takes both and lets expandable segments win: its should_split ignores
        # max_split_size when they are on. Ours grow in place and never split-limit.
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


# --------------------------------------------------------------------------- conf strings


# A conf string quoted in a message is cut here: a message stays one readable line, and
# building it costs the same for a string of any length.
_CONF_SHOWN = 120


def _shown(conf: str) -> str:
    """`conf` as a message quotes it: its repr, cut after _CONF_SHOWN characters."""
    if len(conf) <= _CONF_SHOWN:
        return repr(conf)
    return f"{conf[:_CONF_SHOWN]!r}... ({len(conf):,} characters)"


def _tokenize(conf: str) -> list[str]:
    # PyTorch's ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own, whitespace
    # is dropped everywhere, everything else runs together.
    tokens, buf = [], []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _entries(conf: str, source: str) -> list[tuple[str, str]]:
    """The ``(key, value)`` texts of a conf string, in order; a syntax error raises."""
    if not isinstance(conf, str):
        raise TypeError(f"{source}: a conf string is a str, got {type(conf).__name__}")
    tokens = _tokenize(conf)
    entries = []
    i, n = 0, len(tokens)
    while i < n:
        key = tokens[i]
        if key in ",:[]":
            raise ValueError(f"{source}: expected an option name at {key!r} in {_shown(conf)}; "
                             "write key:value,key:value")
        if i + 1 >= n or tokens[i + 1] != ":":
            name, eq, given = key.partition("=")
            spelled = f"{name}:{given}" if eq and name and given else f"{key}:VALUE"
            raise ValueError(f"{source}: option {key!r:.80} has no value in {_shown(conf)}; "
                             f"write {spelled:.80}" + (" (':' between a key and its value, "
                                                       "not '=')" if eq else ""))
        i += 2
        if i >= n or tokens[i] in ",:]":
            raise ValueError(f"{source}: option {key!r} has an empty value in {_shown(conf)}")
        if tokens[i] == "[":
            try:
                close = tokens.index("]", i)
            except ValueError:
                raise ValueError(f"{source}: option {key!r}: unclosed '[' in {_shown(conf)}") from None
            value = "".join(tokens[i:close + 1])
            i = close + 1
        else:
            value = tokens[i]
            i += 1
        if i < n:
            if tokens[i] != ",":
                raise ValueError(f"{source}: expected ',' after {key}:{value} in {_shown(conf)}, "
                                 f"got {tokens[i]!r}")
            i += 1
        entries.append((key, value))
    return entries


def _backend_ignored(value: str, source: str) -> None:
    if value == "native":
        what = "PyTorch's own caching allocator"
    else:
        what = (f"PyTorch's {value} allocator (the pool's backend 'cuda' draws its segments "
                "from a cudaMemPool with cudaMallocFromPoolAsync)")
    _warn_once(("backend", value),
               f"{source}: 'backend:{value}' selects {what}; the pool takes the place of "
               "PyTorch's allocator, so it has no meaning for the pool and is ignored "
               "(mempool's own backend values are 'cuda', 'sim' and 'host')")


def parse_conf(conf: str, source: str = "conf") -> dict[str, Any]:
    """Parse a conf string in PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax.

    ``"key:value,key:value"``; a list value is bracketed and may hold commas and colons
    (``"roundup_power2_divisions:[256:1,>:8]"``); whitespace is ignored. Every Pool keyword
    is a key (``backend``, ``device`` and ``capacity`` included), and every size option
    ``NAME`` is also ``NAME_mb`` (a whole number of MiB, as PyTorch's
    ``max_split_size_mb``); PyTorch's ``per_process_memory_fraction`` is read onto ``limit``.

    A string PyTorch accepts is accepted here, read the way PyTorch reads it; each of these
    gives one :class:`ConfigWarning` per process:

    - PyTorch's other allocator keys (``pinned_*``, ``release_lock_on_cudamalloc``, ...)
      and its ``backend`` values ``native``/``cudaMallocAsync`` have no meaning for the
      pool and are ignored;
    - an option given twice (in either spelling): the later one wins;
    - with ``backend:cudaMallocAsync``, the caching options PyTorch's cudaMallocAsync
      ignores (``max_split_size``, ``roundup_power2_divisions``,
      ``garbage_collection_threshold``, ``expandable_segments``) are ignored too.

    Parameters
    ----------
    conf : str
        The conf string; ``""`` gives ``{}``.
    source : str
        Where the string came from, named in error and warning messages.

    Returns
    -------
    dict
        Only the options set, under their canonical names, each value parsed (pass it to
        :func:`normalize` for the defaults and the checks between options).

    Raises
    ------
    ValueError
        For a syntax error, a key that is neither an option, an alias nor a PyTorch
        allocator key, or a bad value.
    """
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    async_backend = None
    for key, value in _entries(conf, source):
        if key in _PYTORCH_IGNORED:
            _warn_once(("ignored", key),
                       f"{source}: {key!r} is a PyTorch allocator option with no meaning for "
                       f"the pool ({_PYTORCH_IGNORED[key]}); ignored")
            continue
        if key == "backend" and value in _PYTORCH_BACKENDS:
            _backend_ignored(value, source)
            async_backend = None if value == "native" else value
            continue
        if key in _ALIASES:
            target, read = _ALIASES[key]
        elif key in OPTIONS:
            target, read = key, None
        else:
            raise _unknown_key(key, source)
        try:
            parsed = OPTIONS[target].parse(read(value, key) if read else value, key)
        except ValueError as e:
            raise ValueError(f"{source}: in '{key}:{value}': {e}") from None
        if target in out and ("twice", target) not in _warned:
            # The topic is checked first: a string that repeats a key thousands of times
            # builds this message once, not once a repeat.
            _warn_once(("twice", target),
                       f"{source}: option {target!r} is given twice (as {spelled[target]!r} "
                       f"and {key!r}) in {_shown(conf)}; as in PyTorch, the later one "
                       f"('{key}:{value}') wins")
        out[target] = parsed
        spelled[target] = key
    if async_backend is not None:
        dropped = [name for name in _CACHE_OPTIONS if name in out]
        if dropped:
            _warn_once(("async", async_backend, tuple(dropped)),
                       f"{source}: PyTorch's backend:{async_backend} ignores "
                       f"{', '.join(spelled[name] for name in dropped)} (it has no cache to "
                       "tune); read as PyTorch reads it, so does the pool")
            for name in dropped:
                del out[name]
    return out


def conf_from_env(var: str = "MEMPOOL_CONF") -> dict[str, Any]:
    """Parse the conf string in environment variable ``var`` (unset or empty: ``{}``).

    Errors name the variable.
    """
    return parse_conf(os.environ.get(var, ""), source=f"environment variable {var}")


# --------------------------------------------------------------------------- writing confs


def format_size(nbytes: int) -> str:
    """An exact, short spelling of a byte count: ``"2GiB"``, ``"512MiB"``, ``"1536"``."""
    for unit, name in ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return str(nbytes)


def _roundup_to_conf(divs: list[int]) -> str | None:
    """The shortest PyTorch-syntax spelling that parses back to exactly ``divs``.

    None when every count is 0 (the default, which PyTorch's scalar form cannot spell).
    """
    last = ROUNDUP_INTERVALS - 1
    if all(d == divs[0] for d in divs):
        return None if divs[0] == 0 else str(divs[0])
    tail = last                      # divs[tail:] is the constant run at the end
    while divs[tail - 1] == divs[last]:
        tail -= 1
    lead = 0                         # divs[:lead + 1] is the constant run at the start
    while divs[lead + 1] == divs[0]:
        lead += 1
    # The first key (at `lead`) fills the indices below it; keys we skip in between read
    # as 0; the key just before the tail must be written so that '>' starts after it.
    items = [f"{1 << i}:{divs[i]}" for i in range(lead, tail)
             if divs[i] != 0 or i in (lead, tail - 1)]
    if divs[last] != 0:
        items.append(f">:{divs[last]}")
    return "[" + ",".join(items) + "]"


def _conf_value(name: str, value: Any) -> str:
    parser = OPTIONS[name].parse
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "True" if value else "False"
    if name == "roundup_power2_divisions":
        return _roundup_to_conf(value) or "0"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int) and parser not in (_parse_device, _parse_pool_handle):
        return format_size(value)
    return str(value)


def to_conf(options: Mapping[str, Any]) -> str:
    """Our own conf string (``MEMPOOL_CONF`` syntax) for a set of options.

    Only options that differ from their defaults are written, in table order; the result
    parses back (:func:`parse_conf` then :func:`normalize`) to the same options.
    """
    full = normalize(options)
    items = [f"{name}:{_conf_value(name, value)}" for name, value in full.items()
             if value != _default(name)]
    return ",".join(items)


def canonical_conf(conf: str, source: str = "conf") -> str:
    """`conf` with every option under its canonical name, as :func:`to_conf` writes it.

    Aliases become canonical names, PyTorch keys the pool ignores are left out (warned about
    as :func:`parse_conf` does), and no defaults are added or checks between options made:
    the result builds the same pool as `conf`, on whichever backend that comes to.
    """
    return ",".join(f"{name}:{_conf_value(name, value)}"
                    for name, value in parse_conf(conf, source).items())


def split_pytorch_conf(conf: str, source: str = "conf") -> tuple[str, list[str]]:
    """Split a PyTorch allocator conf string for a process whose CUDA allocator is the pool.

    Returns
    -------
    (str, list of str)
        The entries PyTorch still applies then, as written and in order: those of its pinned
        host-memory allocator (:data:`PYTORCH_HOST_KEYS`); and the keys of the other
        entries, which configure the allocator the pool replaces, or are mempool's own
        (PyTorch refuses a key it does not know, and checks ``backend`` against the
        allocator in use).
    """
    kept, dropped = [], []
    for key, value in _entries(conf, source):
        if key in PYTORCH_HOST_KEYS:
            kept.append(f"{key}:{value}")
        else:
            dropped.append(key)
    return ",".join(kept), dropped


def to_pytorch_conf(options: Mapping[str, Any]) -> str | None:
    """The nearest ``PYTORCH_CUDA_ALLOC_CONF`` string for a set of our options.

    Maps ``max_split_size`` (to whole MB), ``roundup_power2_divisions``,
    ``garbage_collection_threshold``, ``expandable_segments`` and ``limit`` (as
    ``per_process_memory_fraction``, a key of recent PyTorch; a byte limit only when
    ``capacity`` is known). Options PyTorch's allocator has no counterpart for
    (``release_threshold``, ``initial_pool_size``, ``cross_stream_reuse``, the cudaMemPool
    settings) are left out.

    Returns
    -------
    str or None
        None when PyTorch's defaults are already the nearest setting.
    """
    full = normalize(options)
    items = []
    if full["max_split_size"] is not None:
        items.append(f"max_split_size_mb:{max(20, round(full['max_split_size'] / MiB))}")
    roundup = _roundup_to_conf(full["roundup_power2_divisions"])
    if roundup is not None:
        items.append(f"roundup_power2_divisions:{roundup}")
    if full["garbage_collection_threshold"] > 0:
        items.append(f"garbage_collection_threshold:{full['garbage_collection_threshold']!r}")
    if full["expandable_segments"]:
        items.append("expandable_segments:True")
    limit, capacity = full["limit"], full["capacity"]
    if isinstance(limit, int) and capacity is not None:
        limit = min(1.0, limit / capacity)
    if isinstance(limit, float) and limit < 1.0:
        items.append(f"per_process_memory_fraction:{limit!r}")
    return ",".join(items) or None


def _markdown_table() -> str:
    """The option table of docs/options.md, generated so that the two cannot drift apart."""
    rows = ["| option | type | default | meaning | conf spelling | PyTorch equivalent |",
            "|---|---|---|---|---|---|"]
    for name, opt in OPTIONS.items():
        default = _default(name)
        if name == "roundup_power2_divisions":
            shown = "0"
        else:
            shown = repr(default)
        conf = ", ".join([f"`{name}:{opt.example}`"] + [
            f"`{alias}:{_alias_example(alias)}`"
            for alias, (target, _) in _ALIASES.items() if target == name])
        pytorch = opt.pytorch or "none"
        if opt.cuda_only:
            pytorch += " (backend='cuda' only)"
        cells = [f"`{name}`", opt.kind, f"`{shown}`", opt.doc, conf, pytorch]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
