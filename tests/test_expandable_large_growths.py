"""Note [Growth extents], "Large growths" (mempool/_csrc/core/mp_expand.c): a growth of 512
MiB or more is mapped in 32 MiB physical allocations unless max_map_size is set, so that
the blocks that later settle in its region pin 32 MiB each, not a GiB; on sim, where the
maps are counted exactly."""
import os

import pytest

import mempool
from mempool.tools import replay as mreplay
from mempool.tools import trace as mtrace

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = os.path.join(ROOT, "bench", "results", "2026-12-04-h200",
                      "snapshot-resnet-mempool-fcafbfe.pickle.gz")
# torchvision's ResNet-50 trained with cudnn.benchmark on an H200 under PyTorch's
# expandable segments: its peak reserved bytes, the same in every run recorded
# (bench/results/2026-12-04-h200, 2026-12-05-h100-night); mempool's held 8-40 MiB more.
TORCH_EXPANDABLE_RESNET_PEAK = 10_989_076_480


def growth_maps(nbytes, **options):
    """The physical allocations (sizes, address order) and map calls of one growth."""
    pool = mempool.Pool(backend="sim", expandable_segments=True, **options)
    before = pool.stats()["num_device_alloc"]
    ptr = pool.alloc(nbytes)
    (seg,) = [s for s in pool.layout() if not s["is_small"]]
    sizes = [size for _, size in seg["maps"]]
    calls = pool.stats()["num_device_alloc"] - before
    pool.free(ptr)
    pool.check_invariants()
    return sizes, calls


def test_a_large_growth_is_mapped_in_32MiB_allocations():
    sizes, calls = growth_maps(600 * MiB)
    assert sizes == [32 * MiB] * 18 + [24 * MiB]
    assert calls == 19


def test_a_growth_under_512MiB_stays_one_allocation():
    sizes, calls = growth_maps(510 * MiB)
    assert sizes == [510 * MiB] and calls == 1


@pytest.mark.parametrize("max_map", [1 << 30, 64 * MiB])
def test_max_map_size_set_by_the_user_is_kept_for_large_growths(max_map):
    sizes, _ = growth_maps(600 * MiB, max_map_size=max_map)
    assert max(sizes) == min(max_map, 600 * MiB) and sum(sizes) == 600 * MiB


def test_resnet50_with_cudnn_benchmark_holds_no_more_than_pytorchs_expandable_segments():
    # Its warm-up's growths for cuDNN's workspaces are gigabytes; with them in 1 GiB
    # allocations the recorded run held 11,072,962,560 bytes here (1.0166 of peak live).
    r = mreplay.replay(mtrace.load_any(RESNET), conf="expandable_segments:True,granularity:8MiB")
    assert r.peak_reserved_bytes <= TORCH_EXPANDABLE_RESNET_PEAK, r.peak_reserved_bytes
    assert r.ratio < 1.01
