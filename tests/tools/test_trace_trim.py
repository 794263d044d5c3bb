"""The program's Pool.trim(keep) calls in traces: recorded, saved, loaded, replayed.

A trim gives cached segments back until at most `keep` bytes stay cached, so what the pool
reserves next depends on it: a replay without the program's trims holds memory the program
did not. The pool records each call as a ``trim`` entry whose nbytes is its keep, before
what it released, and a replay trims its own pool at the same point.
"""
import json
import sys
import types

import pytest

import mempool
from mempool.cli import trace as cli_trace
from mempool.tools import replay as rp
from mempool.tools import torch_replay
from mempool.tools import trace as mt
from mempool.tools.trace import Event

MiB = 1 << 20
CONFS = [None, "expandable_segments:True"]
CONF_OPTIONS = {None: {}, "expandable_segments:True": {"expandable_segments": True}}


# ---------------------------------------------------------------- a recorded program

def _program(pool, trims=True):
    """Allocations whose layout the trims change, and the pool's reserved bytes right after
    each trim, in order."""
    after_trims = []

    def trim(keep):
        if trims:
            pool.trim(keep)
            after_trims.append(pool.reserved_bytes())

    pool.free(pool.alloc(512 * MiB))
    trim(256 * MiB)          # whole segments go: nothing stays cached
    # Without that trim, b is carved out of the cached 512 MiB and c grows beside it: 1 GiB
    # reserved at the peak, not 576 MiB.
    b = pool.alloc(64 * MiB)
    c = pool.alloc(512 * MiB)
    pool.free(c)
    trim(2 << 30)            # keeps more than is cached: releases nothing
    pool.free(b)
    trim(0)                  # every idle segment goes
    d = pool.alloc(128 * MiB)
    e = pool.alloc(192 * MiB)
    pool.free(d)
    trim(64 * MiB)           # d's segment goes
    pool.free(e)
    return after_trims


def _recorded(conf, trims=True):
    pool = mempool.Pool(backend="sim", **CONF_OPTIONS[conf])
    pool.record_history(True)
    after_trims = _program(pool, trims)
    return pool, after_trims


class _TrimWatch:
    """The replay's pool, noting its reserved bytes after each trim call."""

    def __init__(self, pool):
        self._pool = pool
        self.after_trims = []

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def trim(self, keep):
        self._pool.trim(keep)
        self.after_trims.append(self._pool.reserved_bytes())


@pytest.fixture
def watched(monkeypatch):
    """The pools replay() makes, each behind a _TrimWatch."""
    pools = []
    make = rp._make_pool

    def make_watched(*args):
        pools.append(_TrimWatch(make(*args)))
        return pools[-1]

    monkeypatch.setattr(rp, "_make_pool", make_watched)
    return pools


# ---------------------------------------------------------------- the pool's history

def test_the_pools_history_records_trim_with_its_keep_before_what_it_released():
    pool, _ = _recorded(None)
    history = pool.history()
    trims = [(ptr, nbytes, stream) for action, ptr, nbytes, stream, _ in history
             if action == "trim"]
    assert trims == [(0, 256 * MiB, 0), (0, 2 << 30, 0), (0, 0, 0), (0, 64 * MiB, 0)]
    actions = [entry[0] for entry in history]
    at = actions.index("trim")
    assert actions[at - 1:at + 2] == ["free_completed", "trim", "segment_free"]


def test_save_trace_and_load_keep_the_trims(tmp_path):
    pool, _ = _recorded(None)
    path = tmp_path / "t.jsonl.gz"
    pool.save_trace(path)
    events = mt.load(path)
    assert [(e.action, e.nbytes) for e in events if e.action == "trim"] == [
        ("trim", 256 * MiB), ("trim", 2 << 30), ("trim", 0), ("trim", 64 * MiB)]
    assert [e.action for e in events][:4] == ["alloc", "free", "trim", "alloc"]
    assert all(e.id == 0 and e.stream == 0 for e in events if e.action == "trim")
    # And once more through save: the same events.
    again = tmp_path / "again.jsonl"
    assert mt.save(events, again) == len(events)
    assert list(mt.load(again)) == list(events)


def test_a_trim_to_zero_is_legal_where_an_alloc_of_zero_is_not(tmp_path):
    path = tmp_path / "t.jsonl"
    events = [Event("alloc", 1, MiB, 0, 0), Event("free", 1, 0, 0, 1),
              Event("trim", 0, 0, 0, 2)]
    assert mt.save(events, path) == 3
    assert list(mt.load(path)) == events
    with pytest.raises(ValueError, match="event 0: an alloc needs nbytes > 0"):
        mt.save([("alloc", 1, 0, 0, 0)], path)


# ---------------------------------------------------------------- replayed as the calls

def _footprint(stats):
    return (stats["reserved_bytes.all.peak"], stats["num_device_alloc"],
            stats["num_device_free"])


@pytest.mark.parametrize("conf", CONFS)
def test_a_replay_trims_where_the_program_did(conf, watched, tmp_path):
    pool, after_trims = _recorded(conf)
    path = tmp_path / "t.jsonl"
    pool.save_trace(path)
    r = rp.replay(mt.load(path), conf=conf)
    assert r.trim_calls == 4
    assert _footprint(r.stats) == _footprint(pool.stats())
    assert watched[0].after_trims == after_trims == [0, 576 * MiB, 0, 192 * MiB]


@pytest.mark.parametrize("conf", CONFS)
def test_without_its_trims_the_replay_is_not_the_programs_run(conf):
    pool, _ = _recorded(conf)
    events = mt.from_pool_history(pool.history())
    stripped = rp.replay([e for e in events if e.action != "trim"], conf=conf)
    assert stripped.trim_calls == 0
    assert _footprint(stripped.stats) != _footprint(pool.stats())
    if conf is None:
        # Fixed segments: the cached 512 MiB held b, and c grew beside it.
        assert (stripped.peak_reserved_bytes, pool.stats()["reserved_bytes.all.peak"]) == (
            1024 * MiB, 576 * MiB)
    # What it replays is the program run without its trims.
    untrimmed, _ = _recorded(conf, trims=False)
    assert _footprint(stripped.stats) == _footprint(untrimmed.stats())


def test_every_replay_path_trims():
    pool, after_trims = _recorded(None)
    events = mt.from_pool_history(pool.history())
    peak = pool.stats()["reserved_bytes.all.peak"]
    # Stepped (the trace marks steps), with a time series, and part way (pool_at).
    stepped = rp.replay(mt.Trace(events, {"step_starts": [0, 2, 8]}))   # begun by trims
    assert stepped.peak_reserved_bytes == peak
    # A trim's releases count in the step it begins.
    assert [step["device_free"] for step in stepped.steps] == [0, 1, 3]
    assert rp.replay(events, timeseries=True).peak_reserved_bytes == peak
    prep = rp.prepare(events)
    assert prep.trim_ops[0] == (2, 256 * MiB)
    # Up to the op after the first trim: the trim, then b's alloc, which grows the pool.
    part, live = rp.pool_at(prep, stop=3)
    assert part.reserved_bytes() == after_trims[0] + 64 * MiB
    for p in live:
        part.free(p)


def test_the_replay_command_counts_the_trims(tmp_path, capsys):
    pool, _ = _recorded(None)
    path = tmp_path / "t.jsonl"
    pool.save_trace(path)
    assert cli_trace.main("replay", [str(path)]) == 0
    out = capsys.readouterr().out
    assert "(14 events, 5 allocs, 5 frees, 4 trim calls)" in out
    assert "peak reserved  576.00 MiB (603,979,776 bytes)" in out


def test_prepare_places_the_trims_between_ops():
    events = [Event("alloc", 1, MiB, 0, 0), Event("trim", 0, 5, 0, 1),
              Event("empty_cache", 0, 0, 0, 2), Event("trim", 0, 7, 0, 3),
              Event("free", 1, 0, 0, 4), Event("trim", 0, 0, 0, 5), Event("trim", 0, 9, 0, 6),
              Event("alloc", 2, MiB, 0, 7)]
    prep = rp.prepare(events)
    # The trim right after the empty_cache call finds nothing to release: dropped, as a
    # second empty_cache would be.
    assert prep.trim_ops == [(1, 5), (2, 0), (2, 9)]
    assert prep.empty_cache_ops == [1]
    # At one op index, the trims the trace has before the empty_cache call run first.
    assert rp._cache_calls(prep.empty_cache_ops, prep.trim_ops, 0, 3) == [
        (1, 5), (1, None), (2, 0), (2, 9)]
    assert rp._cache_calls(prep.empty_cache_ops, prep.trim_ops, 2, 3) == [(2, 0), (2, 9)]
    # An allocator with no trim to N bytes empties its cache at the empty_cache call and
    # the trim to 0, and skips the others.
    assert rp.emptying_ops(prep) == [1, 2]
    assert rp.partial_trims(prep) == 2
    assert rp.stretches(prep) == [(0, 1), (1, 2), (2, 3)]


# ---------------------------------------------------------------- refused by name

BAD_TRIMS = [
    (("trim", 7, 0, 0, 0), "a trim event names no buffer: its id is 0; got id 7"),
    (("trim", "x", 0, 0, 0), "a trim event names no buffer: its id is 0; got id 'x'"),
    (("trim", 0, -1, 0, 0), "a trim event's nbytes is trim's keep, an int in \\[0, 2\\*\\*63\\) "
                            "\\(0 accepted\\); got -1"),
    # no pool's cache is that large, and a replay would stop part-way at the pool's refusal
    (("trim", 0, 1 << 63, 0, 0), "a trim event's nbytes is trim's keep, .*; got "
                                 "9223372036854775808"),
    (("trim", 0, 1 << 70, 0, 0), "a trim event's nbytes is trim's keep, .*; got "
                                 "1180591620717411303424"),
    (("trim", 0, 1.5, 0, 0), "a trim event's nbytes is trim's keep, .*; got 1.5"),
    (("trim", 0, "5", 0, 0), "a trim event's nbytes is trim's keep, .*; got '5'"),
    (("trim", 0, True, 0, 0), "a trim event's nbytes is trim's keep, .*; got True"),
]


@pytest.mark.parametrize("bad,message", BAD_TRIMS)
def test_save_refuses_a_bad_trim_event_by_name(tmp_path, bad, message):
    good = Event("alloc", 1, MiB, 0, 0)
    with pytest.raises(ValueError, match="save: event 1: " + message):
        mt.save([good, bad], tmp_path / "t.jsonl")
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("bad,message", BAD_TRIMS)
def test_load_refuses_a_bad_trim_line_by_name(tmp_path, bad, message):
    path = tmp_path / "t.jsonl"
    mt.save([Event("alloc", 1, MiB, 0, 0)], path)
    text = path.read_text().replace('"events":1', '"events":2')
    path.write_text(text + json.dumps(list(bad)) + "\n")
    with pytest.raises(ValueError, match=f"{path}: line 3: " + message):
        mt.load(path)


@pytest.mark.parametrize("bad,message", BAD_TRIMS)
def test_replay_refuses_a_bad_trim_event_by_name(bad, message):
    with pytest.raises(ValueError, match="prepare: event 1: " + message):
        rp.replay([Event("alloc", 1, MiB, 0, 0), bad])


# ---------------------------------------------------------------- outside the pool

def test_a_snapshot_in_pytorchs_format_leaves_trim_out():
    pool, _ = _recorded(None)
    snap = pool.snapshot()
    assert "trim" not in {e["action"] for e in snap["device_traces"][0]}
    # PyTorch's format cannot say trim: what a trim released after a free reads as the
    # program's empty_cache call, as docs/traces.md says.
    events = mt.from_torch_snapshot(snap)
    assert "trim" not in {e.action for e in events}
    assert [e.action for e in events][:4] == ["alloc", "free", "empty_cache", "alloc"]


def _fake_torch(calls):
    """Just what torch_replay uses of PyTorch, noting the empty_cache calls as the op index
    they came before (the allocs made so far)."""
    allocs = []
    stats = {"reserved_bytes.all.peak": 1, "allocated_bytes.all.peak": 1}
    cuda = types.SimpleNamespace(
        Stream=object, synchronize=lambda: None, reset_peak_memory_stats=lambda: None,
        memory_stats=lambda: stats, caching_allocator_delete=lambda p: None,
        caching_allocator_alloc=lambda n, device, stream: allocs.append(n) or len(allocs),
        empty_cache=lambda: calls.append(len(allocs)))
    return types.SimpleNamespace(cuda=cuda, OutOfMemoryError=MemoryError)


def test_the_pytorch_replay_empties_at_a_trim_to_zero_and_counts_the_others(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(calls))
    events = [Event("alloc", 1, MiB, 0, 0), Event("trim", 0, 0, 0, 1),
              Event("alloc", 2, MiB, 0, 2), Event("trim", 0, MiB, 0, 3),
              Event("alloc", 3, MiB, 0, 4), Event("empty_cache", 0, 0, 0, 5),
              Event("alloc", 4, MiB, 0, 6)]
    row = torch_replay.replay(events)
    # Before and after the replay, and before allocs 2 (the trim to 0) and 4.
    assert calls == [0, 1, 3, 4]
    assert row["trims_skipped"] == 1
