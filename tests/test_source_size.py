"""Every source file of the C data plane holds one concern, in at most MAX_LINES lines."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "mempool", "_csrc")
MAX_LINES = 800
# Known to be too long, each to be removed once split (a stale entry fails the test below).
KNOWN: set = set()


def lengths():
    out = {}
    for layer in sorted(os.listdir(CSRC)):
        folder = os.path.join(CSRC, layer)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if name.endswith((".c", ".h", ".cpp")):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    out[f"{layer}/{name}"] = sum(1 for _ in f)
    return out


def test_every_source_file_is_at_most_max_lines():
    sizes = lengths()
    assert "core/mp_core.c" in sizes, "the scan found no sources"
    long = {rel: n for rel, n in sizes.items() if n > MAX_LINES and rel not in KNOWN}
    assert not long, f"split these by concern: {long}"


def test_every_known_long_file_is_still_long():
    sizes = lengths()
    stale = {rel for rel in KNOWN if sizes.get(rel, 0) <= MAX_LINES}
    assert not stale, f"no longer too long: remove from KNOWN in tests/test_source_size.py: {stale}"
