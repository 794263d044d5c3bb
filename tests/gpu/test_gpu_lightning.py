"""Lightning's own training loop on the pool: an unchanged script (tests/data/lightning_train.py)
under ``python -m mempool run``, against the same script on PyTorch's allocator.

Lightning's ``Trainer`` calls what a training run calls and nobody here wrote it: cuDNN
benchmark (``benchmark=True``), bf16 autocast, and ``DeviceStatsMonitor``, which logs
``torch.cuda.memory_stats()`` around every batch. Each run is a process of its own."""
import importlib.util
import json
import os

import pytest

from mempool import _cuda
from _support import ROOT, child

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None:
    pytest.skip("needs PyTorch and torchvision", allow_module_level=True)
if (importlib.util.find_spec("lightning") is None
        and importlib.util.find_spec("pytorch_lightning") is None):
    pytest.skip("needs Lightning", allow_module_level=True)

# Each case trains twice on PyTorch's allocator (the module's fixture) and once on the pool,
# each a process that imports Lightning: over pytest-timeout's 60 s when the tier's workers
# share the host's CPUs (the fixture's two runs alone took 55 s on an H100 host with six
# workers, 2026-12-06).
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SCRIPT = os.path.join(ROOT, "tests", "data", "lightning_train.py")
STEPS = 20


def train(tmp_path, name, under_pool, conf=None):
    """The script's JSON result, run natively or under ``python -m mempool run``."""
    outdir = tmp_path / name
    args = [SCRIPT, str(outdir), str(STEPS)]
    if under_pool:
        ran = child(["--no-cupy", *args], tmp_path, {"MEMPOOL_CONF": conf} if conf else {},
                    timeout=600)
    else:
        ran = child(args, tmp_path, python=(), timeout=600)
    assert ran.returncode == 0, f"{name}: exit {ran.returncode}\n{ran.stdout}\n{ran.stderr}"
    if under_pool:
        assert "torch: hooked on device 0" in ran.stderr, ran.stderr
    lines = [line for line in ran.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{name}: no result\n{ran.stdout}\n{ran.stderr}"
    return json.loads(lines[-1])


def peak_columns(result):
    return {k: v for k, v in result["logged"].items() if k.endswith("allocated_bytes.all.peak")}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning-native")
    return [train(tmp, f"native-{i}", under_pool=False) for i in (1, 2)]


@pytest.mark.parametrize("conf", [None, "expandable_segments:True"], ids=["default", "expandable"])
def test_lightning_trainer_trains_on_the_pool_as_on_pytorchs_allocator(native, tmp_path, conf):
    first, second = native
    assert first["backend"] == "native"
    pooled = train(tmp_path, "mempool", under_pool=True, conf=conf)
    assert pooled["backend"] == "mempool"
    assert pooled["cudnn_benchmark"] is True
    assert len(pooled["losses"]) == len(first["losses"]) == STEPS

    # The same training: the first loss (no update yet) and the last steps' agree with
    # PyTorch's own within the spread of PyTorch against itself or a small tolerance
    # (cuDNN benchmark may pick other algorithms when the free memory it is told differs).
    def close(a, b, spread, rel):
        return abs(a - b) <= max(4 * spread, rel * abs(b))

    spread_first = abs(first["losses"][0] - second["losses"][0])
    assert close(pooled["losses"][0], first["losses"][0], spread_first, 0.01), \
        (pooled["losses"][:3], first["losses"][:3], second["losses"][:3])
    tail = lambda r: sum(r["losses"][-5:]) / 5     # noqa: E731
    assert close(tail(pooled), tail(first), abs(tail(first) - tail(second)), 0.05), \
        (pooled["losses"][-5:], first["losses"][-5:], second["losses"][-5:])

    # DeviceStatsMonitor logged the pool's statistics around every batch, as it logs
    # PyTorch's: the same columns, and peaks that are the model's memory at least.
    assert set(peak_columns(pooled)) == set(peak_columns(first)) != set(), \
        (sorted(pooled["logged"]), sorted(first["logged"]))
    params_bytes = 11_000_000 * 4     # ResNet-18's 11.2 M parameters in float32
    for column, values in peak_columns(pooled).items():
        assert len(values) >= STEPS, (column, len(values))
        assert params_bytes <= max(values) <= pooled["max_memory_allocated"], (column, values)
    assert pooled["max_memory_reserved"] >= pooled["max_memory_allocated"] > 0
    assert pooled["summary_lines"] > 10
