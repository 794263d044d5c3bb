"""The examples on a GPU: each one with backend cuda, all_three.py's side-by-side run, the
per-tenant caps on the device and four frameworks on one pool."""
import json

import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

from _support import GiB, MiB, check_tenant_caps, run_example  # noqa: E402


@pytest.mark.parametrize("name", ["cupy_hook.py", "torch_handoff.py", "torch_allocator.py",
                                  "jax_handoff.py"])
def test_example_on_gpu(name):
    out = run_example(name, "--backend", "cuda")
    assert "backend: cuda" in out


def test_all_three_on_gpu():
    out = run_example("all_three.py", "--steps", "3")
    print(out)   # the side-by-side table, kept in the log of a GPU run (pytest -rP)
    assert "reserved bytes, side by side" in out and "results agree across modes: True" in out
    assert "one pool reserves less than the three side by side: True" in out



def test_trainer_to_reader_on_the_gpu():
    """Every step's weights cross from the trainer's pool to the reader's process through
    torch.multiprocessing, and arrive with the values sent."""
    out = run_example("trainer_to_reader.py", "--steps", "3", timeout=300)
    print(out)
    assert "reader: 3 steps of weights received from the trainer, 3 with every value as sent" \
        in out, out
    assert "trainer: 3 steps, each step's weights sent to the reader and checked there" in out


def test_tenant_caps_on_the_gpu():
    report = json.loads(run_example("tenant_caps.py", "--backend", "cuda",
                                    "--limit", "2GiB", "--chunk", "128MiB"))
    assert report["conf"] == "backend:cuda,limit:2GiB"
    check_tenant_caps(report, 2 * GiB, 128 * MiB)


def test_four_frameworks_on_one_pool():
    out = run_example("four_frameworks.py", "--steps", "2", timeout=600, numba=True)
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

