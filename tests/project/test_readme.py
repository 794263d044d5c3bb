"""The README's API snippet runs as written, on a CPU, and its summary of figures holds only
numbers that BENCHMARKS.md holds."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def first_python_block(text):
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "the README has no ```python block"
    return m.group(1)


def run_snippet(code):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_the_readmes_api_snippet_runs_as_written():
    done = run_snippet(first_python_block(read("README.md")))
    assert done.returncode == 0, done.stderr
    assert "reserved" in done.stdout.lower()        # the summary was printed


def test_a_broken_snippet_fails():
    # What the test above relies on: an error in the block makes the run fail.
    done = run_snippet(first_python_block(read("README.md")) + "\nundefined_name\n")
    assert done.returncode != 0 and "NameError" in done.stderr


def test_the_readme_stays_short_and_says_no_history():
    text = read("README.md")
    assert text.count("\n") <= 150
    assert not re.search(r"\b20\d\d-\d\d", text)


def test_the_readmes_figures_are_in_benchmarks_md():
    text = read("README.md")
    section = text.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    assert 0 < len(rows) <= 10
    benchmarks = read("BENCHMARKS.md")
    numbers = {n.rstrip(",") for row in rows
               for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)", row)}
    numbers -= {"512"}                                 # the request size named in the header
    missing = sorted(n for n in numbers if not re.search(rf"(?<![\d,.]){re.escape(n)}(?![\d,])",
                                                        benchmarks))
    assert not missing, f"figures in the README's summary that BENCHMARKS.md lacks: {missing}"
