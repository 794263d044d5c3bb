"""The README's first command: ``python -m mempool demo`` (here on the simulated device)."""
import os
import re
import subprocess
import sys

import mempool
from _support import run_mempool as run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_on_the_simulated_device():
    out = run("demo", "--backend", "sim")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "demo on backend 'sim'" in text
    # Every latency figure is beside what it compares with, says its unit and which way is
    # better, and the sim figures come with what a GPU shows instead.
    assert "ns per allocate + free pair" in text and "lower is better" in text
    for row in ("two empty C-method calls (the floor)", "mempool Pool.alloc + free",
                "upstream round trip (sim, as cudaMalloc)"):
        assert re.search(re.escape(row) + r"(\s+[\d,]+ ns){4}\n", text), row
    assert "BENCHMARKS.md" in text and "python -m mempool bench" in text
    assert "ordered after stream 1's kernel by an event: True" in text
    assert "host synchronizations: 0 (fewer is better" in text
    assert "1.000 = no waste; lower is better" in text
    ratios = dict(re.findall(r"^\s+(default|expandable_segments)\s+(\d\.\d{3})", text, re.M))
    assert set(ratios) == {"default", "expandable_segments"}
    assert 1.0 <= float(ratios["expandable_segments"]) < float(ratios["default"])
    # The summary has a heading, names the simulated device and no GPU.
    assert "memory summary of the demo's pool on sim, holding three blocks" in text
    assert "mempool memory summary, sim device 0" in text
    assert "GPU reserved" not in text
    assert re.search(r"\| Allocated memory +\| +44033 KiB \| +44033 KiB \| +44033 KiB", text)


def test_cli_help_version_and_unknown_command():
    assert run("--help").returncode == 0
    version = run("--version")
    assert version.returncode == 0 and version.stdout == f"mempool {mempool.__version__}\n"
    bad = run("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def test_a_closed_pipe_ends_a_command_quietly():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "mempool", "replay"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=env)
    proc.stdout.close()                      # the reader gone before a line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


def test_the_host_backend_is_not_called_a_simulated_device():
    from mempool.cli import demo
    assert "host memory" in demo._BACKEND_NOTE["host"]
    assert "simulated" not in demo._BACKEND_NOTE["host"]
    assert "simulated device" in demo._BACKEND_NOTE["sim"]
