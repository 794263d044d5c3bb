"""Note [Large growths] (mempool/_csrc/core/mp_expand.c) on sim, where every call is counted.

A growth past the mapped mark gives back idle whole allocations first only when they add up
to 1/128 of the mark: releases cost a sync, and small growths are many. A growth of at least
an eighth of the mark (and 256 MiB) is rare and costs the driver more than a sync and an
unmap: it releases whatever idle allocation there is. cuDNN's benchmark asks for workspaces
of several GiB that way: ResNet-50's recorded runs peak 16 and 56 MiB lower for one sync.
"""
import pytest

import mempool

MiB = 1 << 20
GiB = 1 << 30


def grow_past_an_idle_hole(big):
    """A 9 GiB mark, a 64 MiB allocation left idle inside the range (below 1/128 of the
    mark), then a request of `big` bytes that no free block holds. Returns the bytes
    reserved above the live ones after it, and the request's upstream calls."""
    pool = mempool.Pool(backend="sim", expandable_segments=True, granularity="8MiB")
    pool.alloc(9 * GiB)
    hole = pool.alloc(64 * MiB)
    pool.alloc(8 * MiB)                      # keeps the hole off the range's end
    pool.free(hole)
    before = pool.stats()
    pool.alloc(big)
    after = pool.stats()
    calls = {k: after[k] - before[k]
             for k in ("num_device_alloc", "num_device_free", "num_stream_syncs")}
    return pool.reserved_bytes() - (9 * GiB + 8 * MiB + big), calls


def test_a_large_growth_gives_back_an_idle_allocation_first():
    over, calls = grow_past_an_idle_hole(2 * GiB)
    assert over == 0
    assert calls == {"num_device_alloc": 2, "num_device_free": 1, "num_stream_syncs": 1}


@pytest.mark.parametrize("big", [512 * MiB, 1 * GiB])
def test_a_smaller_growth_keeps_the_idle_allocation_and_makes_no_sync(big):
    # Below an eighth of the mark the 1/128 share still holds: no release, no sync.
    over, calls = grow_past_an_idle_hole(big)
    assert over == 64 * MiB
    assert calls == {"num_device_alloc": 1, "num_device_free": 0, "num_stream_syncs": 0}


def test_a_large_growth_of_a_small_pool_keeps_the_share():
    # An eighth of a small mark is no large growth: under 256 MiB the share holds.
    pool = mempool.Pool(backend="sim", expandable_segments=True, granularity="8MiB")
    pool.alloc(512 * MiB)
    hole = pool.alloc(16 * MiB)
    pool.alloc(8 * MiB)
    pool.free(hole)
    before = pool.stats()["num_stream_syncs"]
    pool.alloc(200 * MiB)
    assert pool.stats()["num_stream_syncs"] == before
    assert pool.reserved_bytes() == (512 + 16 + 8 + 200) * MiB


@pytest.mark.slow
def test_the_recordings_script_replays_every_recording_and_trace(tmp_path):
    # bench/expandable_recordings.py, which judged the rule: the ResNet-50 rows are the
    # replays tests/tools/test_replay_empty_cache.py pins, the others as before the rule.
    import json
    import os
    import sys
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
    sys.path.insert(0, bench)
    try:
        import expandable_recordings
    finally:
        sys.path.remove(bench)
    out = tmp_path / "rows.json"
    assert expandable_recordings.main(["--json", str(out)]) == 0
    rows = {r["input"]: r for r in json.loads(out.read_text())}
    assert len(rows) == len(expandable_recordings.inputs()) >= 10   # 7 recordings, 3 traces
    resnet = rows["snapshot-resnet-mempool-expandable-d80e541.pickle.gz"]
    assert resnet["peak_reserved"] == 11_031_019_520 - 56 * MiB
    assert rows["transformer_train.jsonl.gz"]["stream_syncs"] == 1
