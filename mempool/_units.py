"""The spellings of a byte count, all from one table of units.

``format_bytes(n)`` is what users read (errors, the demo, ``replay``, ``tune``, plots):
PyTorch's spelling, ``20.00 MiB``, the same as the C core's ``mp_format_bytes``
(mempool/_csrc/core/mp_oom.c). ``format_size(n)`` is the exact spelling *written into conf
strings* (``512MiB``) that ``mempool._config.parse_size`` reads back.
"""
from __future__ import annotations

__all__ = ["format_bytes", "format_size", "PREFIXES"]

#: The binary prefixes, smallest first: PREFIXES[i] is 1024 ** (i + 1) bytes.
PREFIXES = ("KiB", "MiB", "GiB", "TiB", "PiB")
# The units the messages use, largest first: up to TiB, as mp_format_bytes.
_UNITS = tuple((name, 1 << 10 * (i + 1)) for i, name in enumerate(PREFIXES[:4]))[::-1]


def format_bytes(nbytes, exact: bool = False) -> str:
    """``nbytes`` as PyTorch's allocator messages spell it: ``"512 bytes"``, ``"1.50 KiB"``,
    ``"20.00 MiB"``, ``"3.99 GiB"`` (two decimals, binary units).

    With ``exact``, a figure of 1 KiB or more is followed by its exact count,
    ``"3.99 GiB (4,284,481,536 bytes)"``: for messages where the last byte matters (a
    request, a limit). None reads ``"none"`` (an unset limit).
    """
    if nbytes is None:
        return "none"
    n = int(nbytes)
    sign, n = ("-", -n) if n < 0 else ("", n)
    for name, scale in _UNITS:
        if n >= scale:
            text = f"{sign}{n / scale:.2f} {name}"
            return f"{text} ({sign}{n:,} bytes)" if exact else text
    return f"{sign}{n} byte" if n == 1 else f"{sign}{n} bytes"


def format_size(nbytes: int, sep: str = "") -> str:
    """An exact, short spelling of a byte count: ``"2GiB"``, ``"512MiB"``, ``"1536"`` (the
    largest unit that divides it). With ``sep=" "``, ``"20 MiB"``, as a message quotes a
    size that is whole in its unit."""
    for name, scale in _UNITS:
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{sep}{name}"
    return str(nbytes)
