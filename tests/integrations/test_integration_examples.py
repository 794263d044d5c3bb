"""The integration examples run as tests: per-tenant caps (examples/tenant_caps.py) on host
memory here and on the GPU in the GPU tier; four_frameworks.py says why it cannot run
without a GPU, and runs on one."""
import json

import pytest

from _support import check_tenant_caps, gpu_available, run_example

MiB = 1 << 20

def test_tenant_caps_on_host_memory():
    report = json.loads(run_example("tenant_caps.py", "--backend", "host",
                                    "--limit", "256MiB", "--chunk", "16MiB"))
    assert report["conf"] == "backend:host,limit:256MiB,capacity:8GiB"
    check_tenant_caps(report, 256 * MiB, 16 * MiB)

@pytest.mark.skipif(gpu_available(), reason="checks the message given without a GPU")
def test_four_frameworks_says_why_it_cannot_run_without_a_gpu():
    out = run_example("four_frameworks.py")
    assert out.startswith("four_frameworks: needs a GPU.")
    assert "no usable CUDA device" in out and "nothing was run" in out
