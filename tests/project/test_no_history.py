"""The product states mechanism, not history: no dates and no commit hashes in mempool/'s
sources, docs/ or the README. What was measured, when and at which commit belongs in
BENCHMARKS.md (rendered from bench/results/) and docs/decisions.md; git keeps the rest."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = (".py", ".pyx", ".pxi", ".pxd", ".c", ".h", ".cpp")
GENERATED = {os.path.join("mempool", "_core.c")}   # Cython's output

DATE = re.compile(r"\b20\d\d-(?:0[1-9]|1[0-2])\b")
# A commit hash as written in prose: 7-12 lowercase hex digits, standing alone, with both a
# digit and a letter, not a 0x constant and not part of a longer word or number.
HASH = re.compile(r"(?<![\w.])(?!0x)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w])")


def scanned_files():
    yield "README.md"
    for top, suffixes in (("docs", (".md",)), ("mempool", SOURCES)):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "build")]
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)
                if f.endswith(suffixes) and rel not in GENERATED:
                    yield rel


def history(text):
    found = []
    for i, line in enumerate(text.split("\n"), 1):
        for pattern in (DATE, HASH):
            found += [(i, m.group(0)) for m in pattern.finditer(line)]
    return found


@pytest.mark.parametrize("text,found", [
    ("as measured on 2026-12-05", ["2026-12"]),
    ("since commit `4fc5a6f` the pool", ["4fc5a6f"]),
    ("at a193f42, then", ["a193f42"]),
    ("mask 0xdeadbeef and 0x7fffffff", []),
    ("abcdefab deadbeef 12345678 v2.11.0 sm_90a", []),   # letters only, digits only, versions
    ("sha256 of e3b0c44298fc1c149afbf4c8996fb924", []),  # longer than a short hash
])
def test_the_patterns_find_dates_and_hashes_only(text, found):
    assert [m for _, m in history(text)] == found


def test_no_dates_or_commit_hashes_in_the_product():
    bad = []
    for rel in scanned_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            bad += [f"{rel}:{i}: {m}" for i, m in history(f.read())]
    assert not bad, "dated text or commit hashes (history goes to docs/decisions.md or " \
                    "BENCHMARKS.md):\n" + "\n".join(bad)
