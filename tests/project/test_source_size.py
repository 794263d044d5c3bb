"""Every source file of the project holds one concern, in at most MAX_LINES lines: the
package's Python and Cython sources, the C data plane, the tests, the benchmarks and the
examples."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LINES = 800
# Where sources live, and which of their files are sources.
PYTHON = (".py",)
CYTHON = (".pyx", ".pxi", ".pxd", ".pyi")
C = (".c", ".h", ".cpp")
SOURCES = {"mempool": PYTHON + CYTHON + C, "tests": PYTHON + C, "bench": PYTHON + C,
           "examples": PYTHON, "setup.py": PYTHON}
SKIPPED_FOLDERS = {"__pycache__", "build"}
GENERATED = {"mempool/_core.c"}   # Cython's output


def lengths():
    out = {}
    for top, suffixes in SOURCES.items():
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            paths = [path]
        else:
            paths = []
            for folder, dirs, files in os.walk(path):
                dirs[:] = [d for d in dirs if d not in SKIPPED_FOLDERS
                           and not d.endswith(".egg-info")]
                paths += [os.path.join(folder, f) for f in files]
        for file in paths:
            rel = os.path.relpath(file, ROOT).replace(os.sep, "/")
            if file.endswith(suffixes) and rel not in GENERATED:
                with open(file, encoding="utf-8") as f:
                    out[rel] = sum(1 for _ in f)
    return out


def test_the_scan_finds_every_kind_of_source():
    sizes = lengths()
    for rel in ("mempool/_csrc/core/mp_core.c", "mempool/_core.pyx", "mempool/_pool.pxi",
                "mempool/_cdefs.pxd", "mempool/_core.pyi", "mempool/__init__.py",
                "mempool/tools/trace.py", "tests/project/test_source_size.py", "tests/data/fake_libcuda.c",
                "bench/cold_pairs.c", "setup.py"):
        assert rel in sizes, f"the scan missed {rel}"
    assert any(rel.startswith("examples/") for rel in sizes)
    assert not any(rel == "mempool/_core.c" for rel in sizes), "Cython's output is no source"


def test_every_source_file_is_at_most_max_lines():
    sizes = lengths()
    long = {rel: n for rel, n in sizes.items() if n > MAX_LINES}
    assert not long, f"split these by concern: {long}"
