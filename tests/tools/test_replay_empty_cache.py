"""The program's empty_cache calls in traces: the event, its replay, and how a PyTorch snapshot
shows them.

PyTorch's cuDNN benchmark calls empty_cache after every algorithm search. A snapshot records
only what those calls released, and a replay without them held 40 MiB more than the device
did on a recorded ResNet-50 run; with them it holds what the device held, to the byte.
"""
import json
import os
import sys

import pytest

import mempool

from mempool.tools import replay as rp
from mempool.tools import trace as mt
from mempool.tools.trace import Event
from _trace_data import trace_entry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDINGS = os.path.join(REPO, "tests", "data", "recordings")
sys.path.insert(0, os.path.join(REPO, "bench"))
import replay_check  # noqa: E402
MiB = 1 << 20
CUDA_PAGES = "expandable_segments:True,granularity:8MiB"   # the pool's settings on cuda


# ---------------------------------------------------------------- the event

def test_an_empty_cache_event_saves_and_loads(tmp_path):
    events = [Event("alloc", 1, 64 * MiB, 0, 0), Event("free", 1, 0, 0, 1),
              Event("empty_cache", 0, 0, 0, 2), Event("alloc", 2, 8 * MiB, 0, 3)]
    path = tmp_path / "t.jsonl"
    assert mt.save(events, path) == 4
    assert list(mt.load(path)) == events


@pytest.mark.parametrize("bad", [("empty_cache", 7, 0, 0, 0), ("empty_cache", 0, 512, 0, 0)])
def test_an_empty_cache_event_names_no_buffer(tmp_path, bad):
    with pytest.raises(ValueError, match=r"event 0: an empty_cache event names no buffer"):
        mt.save([bad], tmp_path / "t.jsonl")
    assert not (tmp_path / "t.jsonl").exists()


def test_a_replay_refuses_an_empty_cache_event_that_names_a_buffer():
    with pytest.raises(ValueError, match=r"event 1: an empty_cache event names no buffer"):
        rp.replay([Event("alloc", 1, MiB, 0, 0), Event("empty_cache", 1, 0, 0, 1)])


def test_prepare_places_the_calls_between_ops():
    events = [Event("alloc", 1, MiB, 0, 0), Event("empty_cache", 0, 0, 0, 1),
              Event("empty_cache", 0, 0, 0, 2), Event("free", 1, 0, 0, 3),
              Event("empty_cache", 0, 0, 0, 4)]
    prep = rp.prepare(events)
    assert len(prep.ops) == 2
    assert prep.empty_cache_ops == [1, 2]       # two in a row are one call
    assert rp.stretches(prep) == [(0, 1), (1, 2), (2, 2)]


# ---------------------------------------------------------------- replayed as the call

def _big_then_small(with_call):
    events = [Event("alloc", 1, 512 * MiB, 0, 0), Event("free", 1, 0, 0, 1)]
    if with_call:
        events.append(Event("empty_cache", 0, 0, 0, 2))
    return events + [Event("alloc", 2, 64 * MiB, 0, 3), Event("free", 2, 0, 0, 4)]


@pytest.mark.parametrize("conf", [None, CUDA_PAGES])
def test_a_replay_empties_the_cache_where_the_program_did(conf):
    kept = rp.replay(_big_then_small(False), conf=conf)
    emptied = rp.replay(_big_then_small(True), conf=conf)
    assert kept.empty_cache_calls == 0 and emptied.empty_cache_calls == 1
    # Without the call the 64 MiB block reuses the cached 512 MiB; with it, the 512 MiB went
    # back and the block took memory of its own.
    assert (kept.num_device_alloc, kept.num_device_free) == (1, 0)
    assert emptied.num_device_free == 1 and emptied.num_device_alloc == 2
    assert emptied.peak_live_bytes == kept.peak_live_bytes


def test_every_replay_path_honours_the_calls():
    events = _big_then_small(True)
    prep = rp.prepare(events)
    # Stepped: the call (event 2) begins the second step, whose counters see its release.
    stepped = mt.Trace(events, {"step_starts": [0, 2]})
    r = rp.replay(stepped, conf=CUDA_PAGES)
    assert [step["device_free"] for step in r.steps] == [0, 1]
    # With a time series, and part way (pool_at) after the call.
    assert rp.replay(events, conf=CUDA_PAGES, timeseries=True).num_device_free == 1
    pool, live = rp.pool_at(prep, stop=3, conf=CUDA_PAGES)
    assert live and pool.stats()["num_device_free"] == 1
    for p in live:
        pool.free(p)


# ---------------------------------------------------------------- seen in a PyTorch snapshot

def _snapshot(entries, conf="expandable_segments:True", gc=0.0):
    return {"segments": [], "device_traces": [entries],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": conf,
                                   "garbage_collection_threshold": gc}}


A, B = 0x7F0000000000, 0x7F0080000000      # two ranges of address space, apart


def _release_after_free(then):
    """Buffer 1 allocated and freed, a release of its 32 MiB, then `then` (a list of
    entries), then buffer 2."""
    return ([trace_entry("segment_map", A, 32 * MiB), trace_entry("alloc", A, 32 * MiB),
             trace_entry("free_requested", A, 32 * MiB), trace_entry("free_completed", A, 32 * MiB),
             trace_entry("segment_unmap", A, 32 * MiB)] + then
            + [trace_entry("alloc", B, 16 * MiB)])


def _empties(snap, **kw):
    return [e for e in mt.from_torch_snapshot(snap, **kw) if e.action == "empty_cache"]


def test_a_release_after_a_free_is_the_programs_call():
    alone = _release_after_free([])
    joined = _release_after_free([trace_entry("segment_map", A, 16 * MiB)])
    for entries in (alone, joined):
        for conf in ("mempool", "expandable_segments:True"):
            t = mt.from_torch_snapshot(_snapshot(entries, conf))
            assert [e.action for e in t] == ["alloc", "free", "empty_cache", "alloc"]
            assert t.meta["empty_cache_events"] == 1
    assert _empties(_snapshot(alone), empty_cache=False) == []


def test_a_release_for_a_growth_elsewhere_is_the_allocators_own():
    # mempool's high-water rule: idle memory released before a growth apart from it.
    apart = _release_after_free([trace_entry("segment_map", B, 16 * MiB)])
    assert _empties(_snapshot(apart, "mempool")) == []
    # PyTorch's garbage collection does the same.
    assert _empties(_snapshot(apart, "garbage_collection_threshold:0.6", gc=0.6)) == []
    # PyTorch's own allocator without it releases for an allocation only after a failed
    # device allocation, on a device far from full: the program's call.
    assert len(_empties(_snapshot(apart, "expandable_segments:True"))) == 1


def test_odd_settings_are_read_as_no_garbage_collection():
    apart = _release_after_free([trace_entry("segment_map", B, 16 * MiB)])
    for gc in ("0.6", None, [1], True):
        snap = _snapshot(apart)
        snap["allocator_settings"]["garbage_collection_threshold"] = gc
        assert len(_empties(snap)) == 1
    snap = _snapshot(apart)
    snap["allocator_settings"] = "not a dict"
    assert len(_empties(snap)) == 1


def test_a_release_during_an_allocation_is_not_a_call():
    entries = [trace_entry("segment_map", A, 32 * MiB), trace_entry("alloc", A, 32 * MiB),
               trace_entry("segment_unmap", B, 32 * MiB), trace_entry("alloc", B, 16 * MiB)]
    assert _empties(_snapshot(entries)) == []


def test_a_damaged_segment_entry_is_named():
    entries = _release_after_free([])
    del entries[4]["size"]
    with pytest.raises(ValueError, match=r"device_traces\[0\]\[4\]: a segment entry needs"):
        mt.from_torch_snapshot(_snapshot(entries))


# ---------------------------------------------------------------- recorded ResNet-50 runs

# Recorded on an H200 (tests/data/recordings/, the *-b16338f files): ResNet-50 training
# with cudnn.benchmark=True under mempool.torch.install, expandable segments with cuda's
# defaults and with one physical allocation per page. torch.cuda.max_memory_reserved() of
# each process, from snapshot-resnet-b16338f.log, and what Note [Large growths]
# (mp_expand.c, after these runs) takes off that peak: the replay of the code that ran them
# gave the device's peak to the byte, so the replay now gives it less that much. The
# device has not run Note [Large growths] yet.
RESNET_RUNS = [
    ("snapshot-resnet-mempool-expandable-b16338f.pickle.gz", CUDA_PAGES, 11_031_019_520,
     16 * MiB),
    ("snapshot-resnet-mempool-expandable-page-b16338f.pickle.gz",
     CUDA_PAGES + ",max_map_size:8MiB", 10_980_687_872, 40 * MiB),
]
# The same workload recorded on an H100 (the *-d80e541 files),
# the default path too, whose segments cuda rounds to 32 MiB (Note [The cudaMemPool's unit]).
# Its replay gave the device's peak to the byte; the small start of Note [Segment rounding]
# (after this run: plain segments first, then the first rounded one taking the total back
# to whole units) adds one 32 MiB unit to it (a negative saving).
H100_RUNS = [
    ("snapshot-resnet-mempool-d80e541.pickle.gz", "segment_rounding:32MiB", 11_240_734_720,
     -32 * MiB),
    ("snapshot-resnet-mempool-expandable-d80e541.pickle.gz", CUDA_PAGES, 11_031_019_520,
     56 * MiB),
]


@pytest.mark.parametrize("name,conf,device_peak,large_growths_saved", RESNET_RUNS + H100_RUNS)
def test_a_recorded_resnet_run_replays_to_the_devices_peak(name, conf, device_peak,
                                                            large_growths_saved):
    path = os.path.join(RECORDINGS, name)
    events = mt.from_torch_snapshot(path)
    assert events.meta["empty_cache_events"] >= 60          # cuDNN benchmark's calls
    r = rp.replay(events, conf=conf)
    assert r.peak_reserved_bytes == device_peak - large_growths_saved
    # Without the calls the replay is not the device's run.
    assert rp.replay(mt.from_torch_snapshot(path, empty_cache=False),
                     conf=conf).peak_reserved_bytes != device_peak - large_growths_saved


# ---------------------------------------------------------------- in the pool's own history

def _recorded_pool():
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    pool.record_history(True)
    a = pool.alloc(512 * MiB)
    pool.free(a)
    pool.empty_cache()
    b = pool.alloc(64 * MiB)
    pool.free(b)
    return pool


def test_the_pools_history_records_the_call_before_what_it_released(tmp_path):
    pool = _recorded_pool()
    actions = [entry[0] for entry in pool.history()]
    at = actions.index("empty_cache")
    assert actions[at - 1:at + 2] == ["free_completed", "empty_cache", "segment_unmap"]
    # A saved trace keeps it, and its replay gives back what the pool gave back.
    path = tmp_path / "t.jsonl"
    pool.save_trace(path)
    events = mt.load(path)
    assert [e.action for e in events] == ["alloc", "free", "empty_cache", "alloc", "free"]
    r = rp.replay(events, conf="expandable_segments:True")
    assert (r.num_device_alloc, r.num_device_free) == (2, 1)


def test_a_snapshot_for_memory_viz_leaves_the_call_out_and_its_reader_finds_it():
    pool = _recorded_pool()
    snap = pool.snapshot()
    assert "empty_cache" not in {e["action"] for e in snap["device_traces"][0]}
    events = mt.from_torch_snapshot(snap)
    assert [e.action for e in events] == ["alloc", "free", "empty_cache", "alloc", "free"]


def test_the_replay_check_finds_the_device_run(tmp_path, capsys):
    # bench/replay_check.py, as the GPU run's snapshot stage calls it on what it recorded.
    # The peaks this code replays to (the device's, less Note [Large growths]'s saving).
    rows = [{"workload": "resnet", "allocator": "mempool-expandable",
             "snapshot": RESNET_RUNS[0][0], "peak_reserved": RESNET_RUNS[0][2] - RESNET_RUNS[0][3]},
            {"workload": "resnet", "allocator": "mempool-expandable-page",
             "snapshot": RESNET_RUNS[1][0],
             "peak_reserved": RESNET_RUNS[1][2] - RESNET_RUNS[1][3] + 8 * MiB},
            {"workload": "resnet", "allocator": "torch-expandable",
             "snapshot": RESNET_RUNS[0][0], "peak_reserved": 1}]   # not mempool's: left out
    path = tmp_path / "workloads.json"
    path.write_text(json.dumps({"rows": rows}))
    assert replay_check.main([str(path), RECORDINGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0].endswith(": equal") and "mempool-expandable:" in out[0]
    assert out[1].endswith("NOT the device run") and "(-8,388,608;" in out[1]
