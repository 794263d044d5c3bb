"""CUDA graph capture on the simulated device (docs/architecture.md, Note [Graph capture]).

While a stream captures, the simulated device refuses, counts and lets break the capture
every call a real driver refuses or that would break it, as the driver's global capture mode
does: stream and device syncs, stream queries, event queries, event waits across the
capture's edge, segment frees, unmaps. The pool must serve allocations and frees on a
capturing stream under every kind of pressure with none of them, defer what it cannot do
(releases, frees waiting on recorded streams), and do it once the capture is over.
"""
import pytest

import mempool
from mempool import _core
from _support import BASE, MiB
from _support import device_counters as device, stat_subset as stats

S, T, X = 11, 22, 33   # S captures; T is another stream of the pool; X one it never sees


# Calls a capture forbids, as the device counts them: none may move while S captures.
UNSAFE = ("syncs", "stream_queries", "frees", "unmaps")


def states(pool):
    """{address: state} of every block (0 free, 1 allocated, 2 pending, 3 unmapped)."""
    return {b["address"]: b["state"] for s in pool.layout() for b in s["blocks"]}


# ------------------------------------------------------------------ the simulated device


def test_the_device_refuses_and_counts_what_a_capture_forbids(sim):
    pool = sim()
    dev = pool.device
    with pytest.raises(ValueError, match="legacy default stream"):
        dev.begin_capture(0)
    with pytest.raises(ValueError, match="not capturing"):
        dev.end_capture(S)
    a = pool.alloc(4096, stream=T)
    pool.record_stream(a, S)
    dev.launch(S)
    pool.free(a, stream=T)                 # pending: an event on S, not complete
    dev.begin_capture(X)                   # a capture the pool is not told of, on a stream
    assert dev.is_capturing(X) and not dev.is_capturing(S)   # it never sees
    with pytest.raises(ValueError, match="capturing already"):
        dev.begin_capture(X)
    # empty_cache names no stream: it cannot see X's capture, so it queries S's event,
    # synchronizes S and queries again, as the driver's global mode forbids: three violations.
    pool.empty_cache()
    assert dev.capture_violations == 3
    with pytest.raises(RuntimeError, match="invalidated"):
        dev.end_capture(X)
    assert not dev.is_capturing(X)
    pool.empty_cache()                     # no capture now: the same calls are legal
    assert dev.capture_violations == 3
    assert pool.reserved_bytes() == 0


def test_a_pool_told_of_the_capture_makes_none_of_those_calls(sim):
    pool = sim()
    dev = pool.device
    a = pool.alloc(4096, stream=T)
    pool.record_stream(a, S)
    dev.launch(S)
    pool.free(a, stream=T)
    with pytest.raises(ValueError, match="no capture was begun"):
        _core._capture_end(pool)
    _core._capture_begin(pool)             # what PyTorch's glue does around its captures
    dev.begin_capture(X)
    before = device(pool, *UNSAFE, "event_records")
    pool.empty_cache()
    b = pool.alloc(4096, stream=T)         # a new segment: a's stays pending
    pool.record_stream(b, S)
    pool.free(b, stream=T)                 # deferred: no event recorded during the capture
    pool.check_invariants()
    assert dev.capture_violations == 0
    assert device(pool, *UNSAFE, "event_records") == before
    assert states(pool)[a] == states(pool)[b] == 2
    dev.end_capture(X)
    _core._capture_end(pool)               # the last capture: deferred work happens now
    assert device(pool, "event_records")["event_records"] == before["event_records"] + 1
    dev.complete(S)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and dev.capture_violations == 0


# ------------------------------------------------------------------ every kind of pressure


def test_a_free_list_miss_takes_a_segment_outside_the_graph(sim):
    pool = sim()
    dev = pool.device
    dev.begin_capture(S)
    a = pool.alloc(4096, stream=S)
    b = pool.alloc(12 * MiB, stream=S)
    assert (a, b) == (BASE, BASE + 2 * MiB)         # fresh segments, in order
    assert dev.capture_allocs == 2 and device(pool, "allocs")["allocs"] == 2
    pool.free(a)
    assert pool.alloc(4096, stream=S) == a          # the free list serves as usual
    dev.end_capture(S)
    assert dev.capture_violations == 0
    c = pool.alloc(4096, stream=S)                  # after the capture: stream-ordered again
    assert c == BASE + 4096 and dev.capture_allocs == 2


def test_release_threshold_waits_for_the_end_of_the_capture(sim):
    pool = sim(release_threshold=0)
    dev = pool.device
    dev.begin_capture(S)
    a = pool.alloc(12 * MiB, stream=S)
    b = pool.alloc(4096, stream=S)
    pool.free(a)                                    # its segment is idle: not released now
    assert pool.reserved_bytes() == 14 * MiB
    assert device(pool, "frees")["frees"] == 0
    dev.end_capture(S)
    pool.free(b)                                    # the next free releases both
    assert device(pool, "frees", "live_segments") == {"frees": 2, "live_segments": 0}
    assert pool.reserved_bytes() == 0 and dev.capture_violations == 0


def test_release_threshold_resumes_when_the_pool_is_told_the_capture_ended(sim):
    pool = sim(release_threshold=0)
    dev = pool.device
    _core._capture_begin(pool)
    dev.begin_capture(S)
    pool.free(pool.alloc(12 * MiB, stream=S))
    assert pool.reserved_bytes() == 12 * MiB
    dev.end_capture(S)
    _core._capture_end(pool)                        # releases without waiting for a call
    assert pool.reserved_bytes() == 0
    assert device(pool, "frees")["frees"] == 1 and dev.capture_violations == 0


def test_the_limit_refuses_instead_of_releasing_or_waiting(sim):
    pool = sim(limit=32 * MiB)
    dev = pool.device
    pool.free(pool.alloc(20 * MiB, stream=S))       # 20 MiB cached, idle
    x = pool.alloc(4096, stream=T)
    pool.record_stream(x, S)
    dev.launch(S)
    pool.free(x, stream=T)                          # a pending free waiting on S
    dev.begin_capture(S)
    with pytest.raises(mempool.OutOfMemoryError, match="graph capture was under way"):
        pool.alloc(22 * MiB, stream=S)              # room only by releasing the 20 MiB
    assert stats(pool, "num_alloc_retries", "num_sync_all_streams") == \
        {"num_alloc_retries": 0, "num_sync_all_streams": 0}
    assert pool.reserved_bytes() == 22 * MiB and dev.capture_violations == 0
    dev.end_capture(S)
    a = pool.alloc(22 * MiB, stream=S)              # now the idle segment goes for it
    assert a == BASE + 22 * MiB
    assert device(pool, "frees")["frees"] == 1 and pool.reserved_bytes() == 24 * MiB


def test_out_of_device_memory_during_a_capture_skips_the_release_and_retry(sim):
    pool = mempool.Pool(backend="sim", capacity=64 * MiB)
    dev = pool.device
    pool.free(pool.alloc(40 * MiB, stream=S))       # idle, but too small for what follows
    dev.begin_capture(S)
    with pytest.raises(mempool.OutOfMemoryError, match="graph capture was under way"):
        pool.alloc(50 * MiB, stream=S)
    assert stats(pool, "num_alloc_retries")["num_alloc_retries"] == 0
    assert device(pool, *UNSAFE) == {k: 0 for k in UNSAFE}
    dev.end_capture(S)
    assert pool.alloc(50 * MiB, stream=S) == BASE + 40 * MiB
    # The idle segment went back once no capture forbade it (before the new segment, as
    # Note [Reserved high water] does, or by the retry of the fallback chain).
    assert pool.reserved_bytes() == 50 * MiB
    assert dev.capture_violations == 0
    pool.check_invariants()


def test_frees_with_recorded_streams_stay_pending_until_the_capture_ends(sim):
    pool = sim()
    dev = pool.device
    dev.begin_capture(S)
    a = pool.alloc(4096, stream=S)
    b = pool.alloc(8192, stream=S)
    pool.record_stream(a, T)
    pool.free(a)                                    # would record an event on T, query it
    pool.free(b, stream=T)                          # would record one on S (a graph node)
    records = device(pool, "event_records")["event_records"]
    assert records == 0 and states(pool)[a] == states(pool)[b] == 2
    pool.alloc(4096, stream=S)                      # no query of pending frees meanwhile
    pool.check_invariants()
    dev.end_capture(S)
    dev.launch(T)
    pool.alloc(4096, stream=T)                      # first call after: events recorded
    assert device(pool, "event_records")["event_records"] == 2
    assert states(pool)[a] == 2                     # T's work is not done yet ...
    dev.complete(T)
    pool.alloc(512, stream=T)
    assert states(pool)[a] == 0                     # ... now it is: a is free again
    assert dev.capture_violations == 0


def test_other_streams_free_blocks_are_not_taken_during_a_capture(sim):
    pool = sim()
    dev = pool.device
    t = pool.alloc(12 * MiB, stream=T)              # segments of exactly 12 MiB
    dev.launch(T)
    pool.free(t)                                    # a fit on T, its work queued
    dev.begin_capture(S)
    a = pool.alloc(12 * MiB, stream=S)              # no event on T, no wait on S
    assert a == BASE + 12 * MiB and dev.capture_allocs == 1
    assert stats(pool, "num_cross_stream_reuse", "num_event_waits") == \
        {"num_cross_stream_reuse": 0, "num_event_waits": 0}
    dev.end_capture(S)
    assert pool.alloc(12 * MiB, stream=S) == t      # after it, T's block serves S again
    assert stats(pool, "num_cross_stream_reuse", "num_event_waits") == \
        {"num_cross_stream_reuse": 1, "num_event_waits": 1}
    assert dev.capture_violations == 0


def test_expandable_segments_map_but_never_unmap_during_a_capture(sim):
    g = 2 * MiB
    pool = sim(expandable_segments=True, release_threshold=0)
    dev = pool.device
    dev.begin_capture(S)
    a = pool.alloc(5 * MiB, stream=S)               # maps 3 pages, as usual
    b = pool.alloc(4096, stream=S)
    assert device(pool, "maps", "mapped_bytes") == {"maps": 2, "mapped_bytes": 4 * g}
    pool.free(a)                                    # threshold 0: its pages would go
    assert device(pool, "unmaps", "mapped_bytes") == {"unmaps": 0, "mapped_bytes": 4 * g}
    dev.end_capture(S)
    pool.free(b)                                    # S is idle: every page goes now
    assert device(pool, "unmaps", "mapped_bytes") == {"unmaps": 2, "mapped_bytes": 0}
    assert dev.capture_violations == 0


def test_expandable_limit_during_a_capture_is_out_of_memory_not_an_unmap(sim):
    pool = sim(expandable_segments=True, limit=8 * MiB, cross_stream_reuse=False)
    dev = pool.device
    pool.free(pool.alloc(6 * MiB, stream=T))        # T's pages, free and mapped
    dev.begin_capture(S)
    with pytest.raises(mempool.OutOfMemoryError, match="graph capture was under way"):
        pool.alloc(4 * MiB, stream=S)
    assert device(pool, *UNSAFE) == {k: 0 for k in UNSAFE}
    dev.end_capture(S)
    pool.alloc(4 * MiB, stream=S)                   # T's pages are unmapped for it now
    assert device(pool, "unmaps")["unmaps"] == 1 and dev.capture_violations == 0


CONFIGS = [
    {},
    {"release_threshold": 0},
    {"limit": 128 * MiB},
    {"garbage_collection_threshold": 0.5, "limit": 128 * MiB},
    {"expandable_segments": True},
    {"expandable_segments": True, "release_threshold": 0},
    {"expandable_segments": True, "limit": 96 * MiB},
    {"cross_stream_reuse": False, "max_split_size": 32 * MiB},
]


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: ",".join(o) or "default")
def test_a_capture_under_every_pressure_makes_no_illegal_call(sim, options):
    """Before the capture: T holds free blocks of every size, a free waits on T's work,
    both streams have work queued. During it, S allocates and frees in every way."""
    pool = sim(**options)
    dev = pool.device
    held = [pool.alloc(n, stream=T) for n in (4096, 3 * MiB, 24 * MiB, 40 * MiB)]
    dev.launch(T)
    for p in held:
        pool.free(p)
    x = pool.alloc(8192, stream=S)
    pool.record_stream(x, T)
    dev.launch(T)
    pool.free(x)
    dev.launch(S)
    before = device(pool, *UNSAFE)
    dev.begin_capture(S)
    live, refused = [], 0
    for n in (4096, 3 * MiB, 24 * MiB, 512, 30 * MiB, 6 * MiB):
        try:
            live.append(pool.alloc(n, stream=S))
        except mempool.OutOfMemoryError as e:     # the limit, without releasing anything
            assert "graph capture was under way" in str(e)
            refused += 1
        pool.check_invariants()
    assert refused == (2 if "limit" in options else 0)   # 24 and 30 MiB pass the limit
    pool.free(live.pop(1))
    y = live.pop(0)
    pool.record_stream(y, T)
    pool.free(y)
    assert states(pool)[y] == 2                      # deferred: no event until the end
    pool.free(live.pop(0), stream=T)
    live.append(pool.alloc(3 * MiB, stream=S))
    pool.empty_cache()
    pool.trim(0)
    pool.set_release_threshold(0)
    pool.check_invariants()
    assert device(pool, *UNSAFE) == before
    assert dev.capture_violations == 0
    dev.end_capture(S)                               # raises if the capture was broken
    for p in live:
        pool.free(p)
    dev.complete_all()
    pool.empty_cache()                               # what was deferred goes now
    assert pool.used_bytes() == 0 and pool.reserved_bytes() == 0
    assert dev.capture_violations == 0


def test_forget_stream_refuses_a_capturing_stream(sim):
    pool = sim()
    dev = pool.device
    a = pool.alloc(4096, stream=S)
    dev.begin_capture(S)
    with pytest.raises(RuntimeError, match="capture is under way"):
        pool.forget_stream(S)
    dev.end_capture(S)
    pool.free(a)
    pool.forget_stream(S)
    assert pool.layout()[0]["stream"] == 0 and dev.capture_violations == 0


def test_forget_stream_drops_a_deferred_free_waiting_on_that_stream(sim):
    """A free deferred during a capture records its events later; forget_stream of a
    recorded stream before then must leave no event to record on the dead handle."""
    pool = sim()
    dev = pool.device
    dev.begin_capture(S)
    a = pool.alloc(4096, stream=S)
    pool.record_stream(a, T)
    dev.launch(T)
    pool.free(a)                                    # deferred: no event during the capture
    dev.end_capture(S)
    assert states(pool)[a] == 2
    records = device(pool, "event_records")["event_records"]
    pool.forget_stream(T)                           # T synchronized: its use is over
    assert states(pool)[a] == 0
    assert device(pool, "event_records")["event_records"] == records
    assert pool.alloc(4096, stream=S) == a and dev.capture_violations == 0


def test_the_pool_knows_of_captures_on_its_streams_and_of_those_it_is_told(sim):
    """mp_capture_known, which the Pool asks before trimming a cudaMemPool after
    empty_cache / trim (a device sync a capture refuses): told of a capture, or one of the
    pool's streams captures. A stream it never used is beyond its sight."""
    pool = sim()
    dev = pool.device
    a = pool.alloc(4096, stream=S)
    pool.free(a, stream=S)
    b = pool.alloc(4096, stream=T)
    assert not _core._capture_known(pool)
    dev.begin_capture(X)                   # a stream the pool never used
    assert not _core._capture_known(pool)
    dev.end_capture(X)
    for stream in (S, T):                  # a capture on either of its streams
        dev.begin_capture(stream)
        assert _core._capture_known(pool)
        dev.end_capture(stream)
        assert not _core._capture_known(pool)
    _core._capture_begin(pool)             # told, as PyTorch's glue does
    assert _core._capture_known(pool)
    _core._capture_end(pool)
    assert not _core._capture_known(pool)
    dev.begin_capture(S)
    pool.empty_cache()                     # releases nothing meanwhile, breaks nothing
    assert dev.capture_violations == 0
    dev.end_capture(S)
    pool.free(b, stream=T)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0
    pool.check_invariants()
