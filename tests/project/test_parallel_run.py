"""With pytest-xdist installed, `python -m pytest` spreads the tests over one process per CPU
(tests/conftest.py); `-n 0` keeps one process; and a pytest started from inside a run (a
worker, or a test's own child pytest) never starts workers of its own."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("xdist")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = "tests/project/test_single_definitions.py"
WORKERS = re.compile(r"created: \d+/\d+ workers?")


def child_pytest(*args, inherited=False):
    env = {k: v for k, v in os.environ.items()
           if inherited or not k.startswith(("PYTEST_XDIST", "MEMPOOL_TEST_PARALLEL"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", TARGET,
                           *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)


def test_a_plain_run_starts_workers():
    out = child_pytest()
    assert out.returncode == 0, out.stdout + out.stderr
    assert WORKERS.search(out.stdout), out.stdout


def test_n0_runs_in_one_process():
    out = child_pytest("-n", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not WORKERS.search(out.stdout), out.stdout


def test_a_pytest_started_inside_a_run_starts_no_workers():
    out = child_pytest(inherited=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not WORKERS.search(out.stdout), out.stdout
