"""The integration examples run as tests: per-tenant caps (examples/tenant_caps.py) on host
memory here and on the GPU in the GPU tier; four_frameworks.py says why it cannot run
without a GPU, and runs on one."""
import json
import os
import subprocess
import sys

import pytest

from conftest import gpu_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30


def run_example(name, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEMPOOL_CONF", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def check_caps(report, limit, chunk):
    greedy, steady = report["greedy"], report["steady"]
    # The tenant over its cap held exactly what the cap allows, then got the pool's error.
    assert greedy["limit"] == limit and greedy["held_at_oom"] == limit
    assert greedy["chunks"] == limit // chunk and greedy["num_ooms"] == 1
    from mempool._units import format_bytes
    assert f"refused by the pool's limit of {format_bytes(limit, exact=True)}" in greedy["oom"]
    # The other ran on, untouched: rounds after the OOM, its data intact, no OOM of its own.
    assert steady["rounds_after_peer_oom"] >= 5
    assert steady["bad_words"] == 0 and steady["num_ooms"] == 0
    assert chunk <= steady["peak_allocated"] <= limit


def test_tenant_caps_on_host_memory():
    report = json.loads(run_example("tenant_caps.py", "--backend", "host",
                                    "--limit", "256MiB", "--chunk", "16MiB"))
    assert report["conf"] == "backend:host,limit:256MiB,capacity:8GiB"
    check_caps(report, 256 * MiB, 16 * MiB)


@pytest.mark.skipif(gpu_available(), reason="checks the message given without a GPU")
def test_four_frameworks_says_why_it_cannot_run_without_a_gpu():
    out = run_example("four_frameworks.py")
    assert out.startswith("four_frameworks: needs a GPU.")
    assert "no usable CUDA device" in out and "nothing was run" in out


@pytest.mark.gpu
def test_tenant_caps_on_the_gpu():
    report = json.loads(run_example("tenant_caps.py", "--backend", "cuda",
                                    "--limit", "2GiB", "--chunk", "128MiB"))
    assert report["conf"] == "backend:cuda,limit:2GiB"
    check_caps(report, 2 * GiB, 128 * MiB)


@pytest.mark.gpu
def test_four_frameworks_on_one_pool():
    out = run_example("four_frameworks.py", "--steps", "2", timeout=600)
    result = json.loads(out.strip().splitlines()[-1])
    per = result["per_framework"]
    for name in ("PyTorch", "CuPy", "Numba"):
        assert per[name]["allocations"] > 0, (name, out)
    assert result["numba_on_pool"] is True
    assert abs(result["numba_sum"] - result["energy"] / 2) <= 1e-3 * result["energy"]
    assert result["torch_counters"]["failed_allocs"] == 0
    if result["jax"] is not None:
        assert "JAX" in per
    assert "Numba's output array is a pool block: True" in out
