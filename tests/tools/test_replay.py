"""Replaying traces through the pool on the simulated device."""
import os

import numpy as np
import pytest

import mempool
from mempool.tools import replay as rp
from mempool.tools import trace as mt
from mempool.tools.trace import Event

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(REPO, "mempool", "traces")
SMALL = os.path.join(TRACES, "small.jsonl")
MiB = 1 << 20


@pytest.fixture(scope="module")
def small():
    return mt.load(SMALL)


def _figures(r):
    d = r.to_dict()
    d.pop("ns_per_event")
    d.pop("timeseries")
    return d


def test_replay_is_deterministic(small):
    a = rp.replay(small)
    b = rp.replay(small)
    assert _figures(a) == _figures(b)
    assert a.stats == b.stats
    # A prepared trace replays the same as the events.
    assert _figures(rp.replay(rp.prepare(small))) == _figures(a)


def test_replay_figures_are_consistent(small):
    r = rp.replay(small, check=True)
    assert r.events == len(small)
    assert r.allocs + r.frees == len(small)
    assert r.num_ooms == 0 and r.unknown_frees == 0 and r.duplicate_allocs == 0
    assert r.peak_live_bytes == rp.prepare(small).peak_live_bytes
    # Rounding and caching only ever add: reserved >= allocated >= requested.
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes >= r.peak_live_bytes > 0
    assert r.ratio == r.peak_reserved_bytes / r.peak_live_bytes
    assert r.num_device_alloc > 0
    assert r.ns_per_event > 0
    assert "reserved/live" in str(r)


def test_live_peak_of_a_hand_made_trace():
    events = [Event("alloc", 1, 3 * MiB, 0, 0), Event("alloc", 2, 5 * MiB, 0, 1),
              Event("free", 1, 0, 0, 2), Event("alloc", 3, 1 * MiB, 0, 3),
              Event("free", 3, 0, 0, 4), Event("free", 2, 0, 0, 5)]
    r = rp.replay(events)
    assert r.peak_live_bytes == 8 * MiB
    assert r.peak_allocated_bytes >= 8 * MiB
    assert r.allocs == 3 and r.frees == 3


def _record(small, conf):
    pool = mempool.Pool.from_conf(conf, backend="sim")
    pool.record_history(True, max_entries=100_000)
    ptrs = {}
    for ev in small:
        if ev.action == "alloc":
            ptrs[ev.id] = pool.alloc(ev.nbytes, ev.stream)
        else:
            pool.free(ptrs.pop(ev.id))
    return pool


@pytest.mark.parametrize("conf", ["roundup_power2_divisions:4", "expandable_segments:True",
                                  "max_split_size:64MB,release_threshold:0"])
def test_record_save_load_replay_matches_the_live_run(tmp_path, small, conf):
    """Run a trace live on a recording pool, save what it recorded, replay the file under
    the same settings: the replay's figures are the live run's."""
    pool = _record(small, conf)
    live = pool.stats()
    path = tmp_path / "recorded.jsonl.gz"
    assert mt.save_trace(pool, path) == len(small)
    loaded = mt.load(path)
    assert loaded.meta["source"] == "mempool" and loaded.meta["backend"] == "sim"
    assert [ev.action for ev in loaded] == [ev.action for ev in small]
    r = rp.replay(loaded, conf=conf)
    assert r.peak_reserved_bytes == live["reserved_bytes.all.peak"]
    assert r.peak_allocated_bytes == live["allocated_bytes.all.peak"]
    assert r.num_device_alloc == live["num_device_alloc"]
    assert r.num_device_free == live["num_device_free"]
    assert r.unknown_frees == 0 and r.num_ooms == 0


def test_recorded_sizes_are_the_requested_sizes(small):
    pool = _record(small, "roundup_power2_divisions:4")
    recorded = mt.from_pool_history(pool.history())
    assert [ev.nbytes for ev in recorded if ev.action == "alloc"] == \
        [ev.nbytes for ev in small if ev.action == "alloc"]


def test_frees_of_unknown_ids_are_counted_not_fatal():
    events = [Event("free", 99, 512, 0, 0), Event("alloc", 1, 4096, 0, 1),
              Event("free", 1, 0, 0, 2), Event("free", 1, 0, 0, 3)]
    r = rp.replay(events)
    assert r.unknown_frees == 2
    assert r.allocs == 1 and r.frees == 1


def test_alloc_of_a_live_id_frees_the_earlier_buffer_first():
    events = [Event("alloc", 1, 4 * MiB, 0, 0), Event("alloc", 1, 2 * MiB, 0, 1),
              Event("free", 1, 0, 0, 2)]
    r = rp.replay(events)
    assert r.duplicate_allocs == 1
    assert r.peak_live_bytes == 4 * MiB


def test_ooms_are_counted_and_the_replay_goes_on():
    events = [Event("alloc", 1, 30 * MiB, 0, 0), Event("alloc", 2, 30 * MiB, 0, 1),
              Event("alloc", 3, 1 * MiB, 0, 2), Event("free", 2, 0, 0, 3),
              Event("free", 1, 0, 0, 4), Event("free", 3, 0, 0, 5)]
    r = rp.replay(events, limit=40 * MiB)
    assert r.num_ooms == 1
    assert "out of memory" in r.first_oom.lower() or "memory" in r.first_oom.lower()
    # The refused 30 MiB never counted as live; the 1 MiB after it was served.
    assert r.peak_live_bytes == 31 * MiB
    assert r.peak_reserved_bytes <= 40 * MiB
    assert r.frees == 3


def test_timeseries(small):
    r = rp.replay(small, timeseries=True)
    ts = r.timeseries
    n = len(ts["event"])
    assert 0 < n <= rp.TIMESERIES_POINTS
    assert {len(v) for v in ts.values()} == {n}
    assert ts["event"][-1] == len(rp.prepare(small).ops) - 1
    assert np.all(np.diff(ts["event"]) > 0)
    assert int(ts["live_bytes"].max()) == r.peak_live_bytes
    assert int(ts["reserved_bytes"].max()) == r.peak_reserved_bytes
    assert np.all(ts["reserved_bytes"] >= 0)
    # Recording the series does not change what is measured.
    plain = rp.replay(small)
    assert plain.peak_reserved_bytes == r.peak_reserved_bytes
    assert plain.peak_allocated_bytes == r.peak_allocated_bytes
    assert plain.timeseries is None


def test_streams_are_replayed():
    events = [Event("alloc", 1, 4 * MiB, 0, 0), Event("alloc", 2, 4 * MiB, 0x55, 1),
              Event("free", 2, 0, 0x55, 2), Event("free", 1, 0, 0, 3)]
    prep = rp.prepare(events)
    assert prep.streams == [0, 0x55]
    r = rp.replay(events, check=True)
    assert r.allocs == 2 and r.frees == 2 and r.num_ooms == 0


def test_conf_as_string_or_dict_and_bad_input(small):
    a = rp.replay(small, conf="max_split_size:64MB")
    b = rp.replay(small, conf={"max_split_size": 64 * MiB})
    assert _figures(a) == _figures(b)
    with pytest.raises(ValueError, match="backend must be one of"):
        rp.replay(small, backend="gpu")
    with pytest.raises(ValueError, match="conf must be None"):
        rp.replay(small, conf=3)
    with pytest.raises(ValueError):
        rp.replay(small, conf="no_such_option:1")
    with pytest.raises(ValueError,
                       match="action must be 'alloc', 'free', 'empty_cache' or 'trim'"):
        rp.replay([("realloc", 1, 5, 0, 0)])


def test_a_size_the_replay_cannot_count_is_refused_by_name():
    # Live bytes are summed in int64: 2**63 and more, and sizes that are not ints, are refused
    # before anything is replayed; a NumPy int is an int.
    for nbytes in (2 ** 63, 2 ** 70, 1.5, "4096", True):
        with pytest.raises(ValueError, match=r"event 0: an alloc needs nbytes, an int in"):
            rp.replay([("alloc", 1, nbytes, 0, 0)])
    r = rp.replay([("alloc", 1, np.int64(4096), 0, 0), ("free", 1, 0, 0, 1)])
    assert r.peak_live_bytes == 4096


def test_events_of_the_wrong_kind_are_refused_by_name():
    with pytest.raises(ValueError, match=r"event 0: an event's id and stream are ints"):
        rp.replay([("alloc", 1, 4096, [0], 0)])
    with pytest.raises(ValueError, match=r"event 0: an event's id and stream are ints"):
        rp.replay([("alloc", {}, 4096, 0, 0)])
    with pytest.raises(ValueError, match=r"time_ns is an int in \[-2\*\*63, 2\*\*63\); got 9223"):
        rp.replay([("alloc", 1, 4096, 0, 2 ** 63)])
    with pytest.raises(ValueError, match=r"from_pool_history: entry 1: .* ints"):
        mt.from_pool_history([("alloc", 1, 4096, 0, 0), ("alloc", 2, {}, 0, 0)])
    with pytest.raises(ValueError, match=r"from_pool_history: entry 0: "):
        mt.from_pool_history([("free_requested", float("inf"), 1, 0, 0)])


def test_a_path_replays_as_its_loaded_trace(small):
    # A user passing the file itself got "not enough values to unpack": each character of
    # the path was taken for an event.
    assert _figures(rp.replay(SMALL)) == _figures(rp.replay(small))
    import pathlib
    assert _figures(rp.replay(pathlib.Path(SMALL))) == _figures(rp.replay(small))


@pytest.mark.parametrize("bad", [[("alloc", 1, 5)], [42], [None], ["free"]])
def test_an_event_of_the_wrong_shape_is_named(bad):
    with pytest.raises(ValueError, match=r"event 0: an event is a trace.Event or a 5-tuple"):
        rp.replay(bad)


def test_pool_at(small):
    full = rp.replay(small)
    pool, ptrs = rp.pool_at(small)            # where reserved bytes reach their peak
    assert pool.reserved_bytes() == full.peak_reserved_bytes
    snap = pool.snapshot()
    assert sum(s["total_size"] for s in snap["segments"]) == pool.reserved_bytes()
    for p in ptrs:
        pool.free(p)
    assert pool.used_bytes() == 0
    pool, ptrs = rp.pool_at(small, stop="peak_live")
    assert pool.stats()["requested_bytes.all.current"] == full.peak_live_bytes
    pool, ptrs = rp.pool_at(small, stop=3)
    assert len(ptrs) <= 3
    with pytest.raises(ValueError, match="stop must be an int"):
        rp.pool_at(small, stop=-1)


@pytest.mark.parametrize("conf", [None, "expandable_segments:True"])
def test_peak_excess_names_the_hole_the_growing_request_did_not_fit(conf):
    # A 20 MiB hole between two live blocks, then a 30 MiB request: the pool grows, and at
    # that peak the hole is the excess over live.
    MiB = 1 << 20
    events = [Event("alloc", 1, 20 * MiB, 0, 0), Event("alloc", 2, 20 * MiB, 0, 1),
              Event("alloc", 3, 20 * MiB, 0, 2), Event("free", 2, 0, 0, 3),
              Event("alloc", 4, 30 * MiB, 0, 4)]
    at = rp.peak_excess(events, conf=conf)
    assert at["request_bytes"] == 30 * MiB
    assert at["free_bytes"] == at["largest_free_bytes"] == 20 * MiB and at["free_blocks"] == 1
    assert at["live_bytes"] == 70 * MiB
    assert at["reserved_bytes"] == rp.replay(events, conf=conf).peak_reserved_bytes
    assert at["request_kind"] == "large"
    assert at["free_before_its_kind"] == at["largest_free_before_its_kind"] == 20 * MiB


def test_peak_excess_counts_apart_what_the_other_kind_holds():
    # Large free blocks cannot serve a small request: a 512 KiB request that grows the pool
    # while 40 MiB lies free in large segments finds none of it in its own kind.
    MiB = 1 << 20
    events = [Event("alloc", 1, 20 * MiB, 0, 0), Event("alloc", 2, 20 * MiB, 0, 1),
              Event("alloc", 3, 20 * MiB, 0, 2), Event("free", 2, 0, 0, 3),
              Event("alloc", 4, 512 << 10, 0, 4)]
    at = rp.peak_excess(events)
    assert at["request_bytes"] == 512 << 10 and at["request_kind"] == "small"
    assert at["free_bytes"] >= 20 * MiB
    assert at["free_before_its_kind"] == 0


def test_peak_excess_sees_the_program_empty_the_cache_just_before_the_request():
    # The free 20 MiB segment went back at the program's empty_cache, before the request
    # that set the peak: the request found nothing free.
    MiB = 1 << 20
    events = [Event("alloc", 1, 20 * MiB, 0, 0), Event("alloc", 2, 20 * MiB, 0, 1),
              Event("free", 2, 0, 0, 2), Event("empty_cache", 0, 0, 0, 3),
              Event("alloc", 3, 30 * MiB, 0, 4)]
    at = rp.peak_excess(events)
    assert at["request_bytes"] == 30 * MiB and at["reserved_bytes"] == 50 * MiB
    assert at["free_before_its_kind"] == 0


def test_peak_excess_adds_up_to_the_peak(small):
    at = rp.peak_excess(small)
    assert at["reserved_bytes"] == rp.replay(small).peak_reserved_bytes
    assert at["reserved_bytes"] == at["live_bytes"] + at["rounding_bytes"] + at["free_bytes"]
    assert at["request_bytes"] in {op[1] for op in rp.prepare(small).ops if op[1]}
    with pytest.raises(ValueError, match="backend must be 'sim' or 'host'"):
        rp.peak_excess(small, backend="cuda")
    assert rp.peak_excess([])["request_bytes"] == 0


def test_replay_100k_events(benchmark):
    """The speed bar: 100,000 events in well under a second on sim (a benchmark, reported)."""
    tr = mt.load(os.path.join(TRACES, "transformer_train.jsonl.gz"))
    events = list(tr) * 5
    # Make the copies' ids distinct so each copy is a separate run of the loop.
    events = [ev._replace(id=(i // len(tr), ev.id)) for i, ev in enumerate(events)]
    prep = rp.prepare(events)
    assert len(prep.ops) >= 100_000
    result = benchmark.pedantic(rp.replay, args=(prep,), rounds=1, iterations=1)
    assert result.events == len(events) and result.num_ooms == 0
