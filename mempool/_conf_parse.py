"""Pool options, part one: reading values. The errors and warnings of every option, the
parser of each kind of value (sizes, fractions, bools, the rounding divisions) and the
tokenizer of conf strings (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax), the one reader of
``key:value,key:value`` text in the package. ``mempool._config`` is the way in (its
docstring says how the parts fit).
"""
from __future__ import annotations

import math
import numbers
import operator
import os
import re
import sys
import warnings
from fractions import Fraction
from typing import Any, Mapping

# The size policy is the C core's, read from the extension (mempool/_policy.pxi): this
# module is imported while the extension initialises, after it has set these names. So are
# the backend kinds (mempool/_common.pxi) and the core's "no limit".
from mempool._core import (_BACKENDS, DEFAULT_MAX_MAP, LARGE_SEGMENT, MAX_ALLOC,
                           MIN_LARGE_ALLOC, ROUNDUP_INTERVALS, SMALL_SEGMENT, SMALL_SIZE,
                           UNLIMITED)
from mempool._cuda import POOL_HANDLES
from mempool._units import format_bytes, format_size

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# PyTorch refuses max_split_size_mb below kLargeBuffer (20 MiB) and so do we, for the same
# reason: requests of 1-10 MiB are served from 20 MiB segments (LARGE_SEGMENT), and a
# max_split_size below that would make every such segment unsplittable, one segment per request.
MIN_MAX_SPLIT_SIZE = LARGE_SEGMENT


def _mib(nbytes: int) -> str:
    """A size of the policy, all whole MiB, as messages spell it: ``20 MiB``."""
    return format_size(nbytes, " ")


# The backends by name, in the order of their kinds in the core (mempool/_common.pxi).
BACKENDS = tuple(_BACKENDS)
# The values of PyTorch's own `backend` key: which of its allocators serves CUDA tensors.
PYTORCH_BACKENDS = ("native", "cudaMallocAsync", "hipMallocAsync")


def _spelled(words: tuple, last: str) -> str:
    """``'a', 'b' or 'c'``: quoted words as a message lists them."""
    quoted = [repr(w) for w in words]
    return f"{', '.join(quoted[:-1])} {last} {quoted[-1]}" if len(quoted) > 1 else quoted[0]

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
# The words for "no limit" (None in Python, the core's UNLIMITED), and how a message says so.
_NONE_WORDS = ("none", "unlimited")
_NONE_ACCEPTED = "None / " + " / ".join(repr(w) for w in _NONE_WORDS)
_TRUE_WORDS = ("true", "1")
_FALSE_WORDS = ("false", "0")

_SIZE_ACCEPTED = ("an int >= 0 (bytes) or a string such as '512', '4KB', '512MiB', "
                  "'1.5GB' (KB/MB/GB/TB and KiB/MiB/GiB/TiB are all powers of 1024), "
                  "below 2**64")
# Sizes are size_t in the core. The largest one, 2**64 - 1, is the core's "no limit", so
# options whose None means unlimited stop one below it (a limit of 2**64 - 1 bytes would
# silently be no limit at all).
SIZE_END = 2 ** 64
UNLIMITED_END = UNLIMITED
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


def _was_warned(topic: Any) -> bool:
    """True once `topic` has been warned of in this process (a caller can then skip
    building a costly message)."""
    return topic in _warned


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
    return _size_or_none(value, key, f"{_SIZE_ACCEPTED}, or {_NONE_ACCEPTED}")


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
                f"'none' (the default: {_mib(DEFAULT_MAX_MAP)}, one page under a limit)")
    n = _size_or_none(value, key, accepted)
    if n == 0:
        raise _error(key, value, accepted, "a growth must map at least one page per allocation")
    return n


def _parse_min_map_size(value: Any, key: str) -> int | None:
    accepted = ("a size: an int (bytes) or a string such as '64MiB'; or None / 'none' / 0 "
                "(the default: a growth maps what its request needs)")
    n = _size_or_none(value, key, accepted)
    return n or None


def _parse_map_ahead(value: Any, key: str) -> int | None:
    accepted = ("a size above 0: an int (bytes) or a string such as '64MiB'; or None / 'none' "
                "(the default: no mapper thread)")
    n = _size_or_none(value, key, accepted)
    if n == 0:
        raise _error(key, value, accepted, "a mapper keeping 0 bytes ahead would map nothing: "
                     "write None to turn it off")
    return n


def _parse_max_split_size(value: Any, key: str) -> int | None:
    accepted = (f"a size of at least {_mib(MIN_MAX_SPLIT_SIZE)}, or {_NONE_ACCEPTED} "
                "(split every block)")
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
                f"capacity in (0, 1] such as 0.5 or '0.5', or {_NONE_ACCEPTED}")
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


def _parse_optional_bool(value: Any, key: str) -> bool | None:
    """True, False, or None (the backend decides); strings as _parse_bool, and 'none'."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    try:
        return _parse_bool(value, key)
    except ValueError:
        raise _error(key, value, "True/False, None (the backend decides), or a string "
                     "'true'/'false'/'none'/'1'/'0'") from None


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
    accepted = _spelled(BACKENDS, "or")
    if isinstance(value, str):
        name = value.strip()
        if name in BACKENDS:
            return name
        if name in PYTORCH_BACKENDS:
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


def _loose_entries(conf: Any) -> list[tuple[str, str]]:
    """The ``(key, value)`` texts of a conf string, in order, read without refusing anything:
    for a reader that must leave a malformed string's errors to PyTorch. Entries end at the
    commas outside brackets; a key is an entry's first token, its value the tokens after
    its ':' ("" without one); an entry that starts with a separator is skipped, as is
    anything but a str."""
    if not isinstance(conf, str):
        return []
    entries, piece, depth = [], [], 0
    for token in _tokenize(conf) + [","]:
        if token == "[":
            depth += 1
        elif token == "]":
            depth = max(depth - 1, 0)
        if token != "," or depth:
            piece.append(token)
            continue
        if piece and piece[0] not in ",:[]":
            has_value = len(piece) > 1 and piece[1] == ":"
            entries.append((piece[0], "".join(piece[2:]) if has_value else ""))
        piece = []
    return entries


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

