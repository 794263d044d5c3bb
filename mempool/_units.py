"""The one spelling of a byte count in every message and report: PyTorch's, ``20.00 MiB``.

``format_bytes(n)`` is what users read (errors, the demo, ``replay``, ``tune``, plots);
``mempool._config.format_size`` is something else, the exact spelling *written into conf
strings* (``512MiB``) that ``parse_size`` reads back.
"""
from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


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
