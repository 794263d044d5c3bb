"""``python -m mempool replay --compare`` on the device: mempool's two modes and PyTorch's
caching allocator, default and expandable segments, replaying one trace side by side."""
import importlib.util
import json
import os

import pytest

from mempool import _cuda
from _support import ROOT, run_mempool

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

SMALL = os.path.join(ROOT, "mempool", "traces", "small.jsonl")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_replay_compare_with_pytorchs_rows():
    done = run_mempool("replay", SMALL, "--backend", "cuda", "--compare", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    d = json.loads(done.stdout)
    assert [r["allocator"] for r in d["rows"]] == [
        "mempool", "mempool expandable_segments", "PyTorch default",
        "PyTorch expandable_segments:True"]
    assert d["note"] is None
    steps = None
    for row in d["rows"]:
        assert "error" not in row, row
        assert row["ratio"] >= 1.0 and row["ns_per_event"] > 0 and row["num_ooms"] == 0
        # every row counts its upstream calls over the same training steps of the trace
        assert steps is None or len(row["calls_per_step"]) == steps
        steps = len(row["calls_per_step"])
    # The same live bytes went through every allocator.
    assert len({row["peak_live_bytes"] for row in d["rows"]}) == 1
    # mempool's default segments come from a cudaMemPool that keeps what the pool gives
    # back: it held at least the pool's own peak; expandable segments map their own pages.
    default, expandable = d["rows"][0], d["rows"][1]
    assert default["driver_reserved_peak_bytes"] >= default["peak_reserved_bytes"]
    assert expandable["driver_reserved_peak_bytes"] is None
