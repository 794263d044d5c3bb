"""Out of memory: the fallback chain step by step, fault injection in the middle of it,
the error's message, and the pool after the error.

The chain, for a request no free list can serve: the stream's own lists, other streams'
lists (through an event wait), release of idle segments where garbage collection or the
limit ask for it, the upstream; when the upstream refuses: release enough cached memory
and retry (retry 1), then wait for the streams pending frees wait on, release everything
cached and retry (retry 2); then OutOfMemoryError.

``device.fail_next(n)`` makes the next n upstream segment allocations fail: with nothing
cached, fail_next(1) and fail_next(2) are absorbed by the two retries and fail_next(3)
raises.
"""
import ctypes

import pytest

import mempool
from _support import BASE, MiB

S1, S2 = 7, 9


def counters(pool):
    st = pool.stats()
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
            "num_sync_all_streams")
    return {k: st[k] for k in keys}


def device(pool, *keys):
    c = pool.device.counters()
    return {k: c[k] for k in keys}


def live_blocks(pool):
    """(address, size, requested, stream) of every allocated block."""
    return [(b["address"], b["size"], b["requested_size"], b["stream"])
            for s in pool.layout() for b in s["blocks"] if b["state"] == 1]


# --------------------------------------------------------------------------- fault injection


@pytest.mark.parametrize("nbytes, segment", [(4096, 2 * MiB), (4 * MiB, 20 * MiB),
                                             (30 * MiB, 30 * MiB)])
@pytest.mark.parametrize("failures", [1, 2])
def test_injected_failures_are_absorbed_by_the_retries(sim, nbytes, segment, failures):
    pool = sim()
    pool.device.fail_next(failures)
    ptr = pool.alloc(nbytes)
    assert ptr == BASE
    assert counters(pool) == {"num_alloc_retries": failures, "num_ooms": 0,
                              "num_device_alloc": 1, "num_device_free": 0,
                              "num_sync_all_streams": 0}
    assert device(pool, "allocs", "failed", "live_segments") == \
        {"allocs": 1, "failed": failures, "live_segments": 1}
    assert pool.reserved_bytes() == segment
    pool.free(ptr)


@pytest.mark.parametrize("nbytes", [4096, 4 * MiB, 30 * MiB])
def test_a_third_failure_raises_and_the_pool_stays_usable(sim, nbytes):
    pool = sim()
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(nbytes)
    assert counters(pool) == {"num_alloc_retries": 2, "num_ooms": 1, "num_device_alloc": 0,
                              "num_device_free": 0, "num_sync_all_streams": 0}
    assert device(pool, "allocs", "failed", "live_segments") == \
        {"allocs": 0, "failed": 3, "live_segments": 0}
    assert pool.reserved_bytes() == 0 and pool.layout() == []
    ptr = pool.alloc(nbytes)                 # the injection is used up: this one succeeds
    assert ptr == BASE
    assert counters(pool)["num_ooms"] == 1
    pool.free(ptr)


def test_out_of_memory_error_is_a_memory_error(sim):
    pool = sim()
    pool.device.fail_next(3)
    with pytest.raises(MemoryError):
        pool.alloc(1)


@pytest.mark.parametrize("failures, outcome", [
    (1, "ok"),      # retry 1 released the idle segment and the upstream then agreed
    (2, "ok"),      # retry 2
    (3, "oom"),
])
def test_retries_release_the_cache_first(sim, failures, outcome):
    pool = sim()
    pool.free(pool.alloc(12 * MiB))          # an idle 12 MiB segment at BASE
    pool.device.fail_next(failures)
    if outcome == "ok":
        ptr = pool.alloc(30 * MiB)           # no fit in the cache: upstream
        assert ptr == BASE + 12 * MiB
        assert [s["address"] for s in pool.layout()] == [BASE + 12 * MiB]
        pool.free(ptr)
    else:
        with pytest.raises(mempool.OutOfMemoryError):
            pool.alloc(30 * MiB)
        assert pool.layout() == []
    # Retry 1 released what was cached: the idle segment went back before the second try.
    assert counters(pool) == {"num_alloc_retries": min(failures, 2),
                              "num_ooms": int(outcome == "oom"),
                              "num_device_alloc": 1 + (outcome == "ok"),
                              "num_device_free": 1, "num_sync_all_streams": 0}
    assert device(pool, "failed", "frees") == {"failed": failures, "frees": 1}


def test_retry_two_waits_for_pending_frees_and_reuses_their_block(sim):
    pool = sim()
    a = pool.alloc(12 * MiB, S1)
    pool.record_stream(a, S2)
    pool.device.launch(S2)
    pool.device.launch(S1)
    pool.free(a)                             # pending until S2's work is done
    pool.device.fail_next(2)
    b = pool.alloc(12 * MiB, S1)
    # Retry 1 had nothing to release; retry 2 synchronized S2 (only S2), after which a's
    # block was free and served the request without a third upstream call.
    assert b == a
    assert counters(pool) == {"num_alloc_retries": 2, "num_ooms": 0, "num_device_alloc": 1,
                              "num_device_free": 0, "num_sync_all_streams": 1}
    assert device(pool, "allocs", "failed", "syncs") == {"allocs": 1, "failed": 2, "syncs": 1}
    assert pool.device.stream_info(S2) == {"submitted": 1, "completed": 1}
    assert pool.device.stream_info(S1) == {"submitted": 1, "completed": 0}
    pool.free(b)


def test_pending_frees_are_waited_for_only_as_a_last_resort(sim):
    pool = sim()
    a = pool.alloc(12 * MiB, S1)
    pool.record_stream(a, S2)
    pool.device.launch(S2)
    pool.free(a)
    pool.device.fail_next(1)
    b = pool.alloc(12 * MiB, S1)             # retry 1 succeeds upstream: no sync
    assert b == BASE + 12 * MiB
    assert counters(pool)["num_sync_all_streams"] == 0
    assert pool.device.counters()["syncs"] == 0
    pool.free(b)
    pool.device.complete(S2)


def test_other_streams_free_blocks_come_before_the_upstream(sim):
    pool = sim()
    a = pool.alloc(12 * MiB, S1)
    seq = pool.device.launch(S1)             # S1 still has work queued when a is freed
    pool.free(a)
    pool.device.fail_next(1)
    b = pool.alloc(12 * MiB, S2)             # S1's free block, after an event wait
    assert b == BASE
    assert device(pool, "allocs", "failed", "waits", "syncs") == \
        {"allocs": 1, "failed": 0, "waits": 1, "syncs": 0}
    assert pool.device.ordered(S2, S1, seq)  # S2's work now runs after S1's
    assert pool.stats()["num_cross_stream_reuse"] == 1
    c = pool.alloc(12 * MiB, S2)             # now the upstream: the injection strikes here
    assert c == BASE + 12 * MiB and pool.stats()["num_alloc_retries"] == 1
    pool.free(b)
    pool.free(c)


def test_real_device_exhaustion_goes_through_the_same_chain(sim):
    pool = sim(capacity="40MiB")
    a = pool.alloc(12 * MiB)
    pool.free(pool.alloc(14 * MiB))          # idle 14 MiB at BASE + 12 MiB
    b = pool.alloc(20 * MiB)                 # 26 + 20 > 40: retry 1 releases the 14 MiB
    assert b == BASE + 26 * MiB
    assert counters(pool) == {"num_alloc_retries": 1, "num_ooms": 0, "num_device_alloc": 3,
                              "num_device_free": 1, "num_sync_all_streams": 0}
    assert device(pool, "failed") == {"failed": 1}
    with pytest.raises(mempool.OutOfMemoryError, match=r"capacity 40.00 MiB\)"):
        pool.alloc(10 * MiB)                 # 32 + 10 > 40 and nothing left to release
    assert counters(pool)["num_alloc_retries"] == 3 and counters(pool)["num_ooms"] == 1
    c = pool.alloc(MiB)                      # a 2 MiB small segment fits the 8 MiB left
    assert c == BASE + 46 * MiB
    for p in (a, b, c):
        pool.free(p)


# --------------------------------------------------------------------------- the message


def test_message_names_the_request_the_pool_and_the_device(sim):
    pool = sim(capacity="100MiB")
    a = pool.alloc(30 * MiB)
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError) as err:
        pool.alloc(3000, S1)
    assert str(err.value) == (
        "out of memory: tried to allocate 2.93 KiB (3,000 bytes), rounded to 3.00 KiB, on "
        "stream 0x7; refused by sim device 0 (capacity 100.00 MiB); the pool has 30.00 MiB "
        "reserved, 30.00 MiB used, 0 bytes cached, largest free block 0 bytes. Hint: free "
        "memory, reduce the request, or set 'limit' on other pools sharing the device.")
    pool.free(a)


def test_message_names_the_limit_when_the_limit_refuses(sim):
    pool = sim(capacity="1GiB", limit="40MiB")
    a = pool.alloc(24 * MiB)
    with pytest.raises(mempool.OutOfMemoryError) as err:
        pool.alloc(20 * MiB)
    assert str(err.value) == (
        "out of memory: tried to allocate 20.00 MiB (20,971,520 bytes), rounded to 20.00 MiB, "
        "on stream 0x0; refused by the pool's limit of 40.00 MiB (41,943,040 bytes), on a "
        "device of capacity 1.00 GiB; the pool has 24.00 MiB reserved, 24.00 MiB used, "
        "0 bytes cached, largest free block 0 bytes. Hint: raise 'limit', or free memory.")
    pool.free(a)


def test_message_names_a_limit_that_did_not_refuse(sim):
    pool = sim(capacity="1GiB", limit="512MiB")
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError,
                       match=r"refused by sim device 0 \(capacity 1.00 GiB, pool limit 512.00 MiB\)"):
        pool.alloc(MiB)


def fragmented_pool(sim, **options):
    """One 20 MiB segment of ten 2 MiB blocks, every other one freed: 10 MiB cached in
    2 MiB holes. Returns the pool and its live blocks."""
    pool = sim(**options)
    ptrs = [pool.alloc(2 * MiB) for _ in range(10)]
    assert ptrs == [BASE + 2 * MiB * i for i in range(10)]
    for p in ptrs[::2]:
        pool.free(p)
    return pool, ptrs[1::2]


def test_message_suggests_expandable_segments_when_free_memory_is_fragmented(sim):
    pool, live = fragmented_pool(sim, capacity="20MiB")
    with pytest.raises(mempool.OutOfMemoryError) as err:
        pool.alloc(4 * MiB)
    msg = str(err.value)
    assert ("the pool has 20.00 MiB reserved, 10.00 MiB used, 10.00 MiB cached, largest free "
            "block 2.00 MiB") in msg
    assert msg.endswith("Hint: free memory is fragmented (10.00 MiB cached, but no free block "
                        "holds 4.00 MiB): expandable_segments=True lets free neighbours merge.")
    hole = pool.alloc(2 * MiB)               # a request that fits a hole still succeeds
    assert hole in {BASE + 4 * MiB * i for i in range(5)}
    assert pool.device.counters()["allocs"] == 1
    for p in live + [hole]:
        pool.free(p)


def test_message_suggests_expandable_segments_under_a_limit_too(sim):
    pool, live = fragmented_pool(sim, limit="20MiB")
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 20.00 MiB.*fragmented.*"
                       r"expandable_segments=True lets free neighbours merge, or raise 'limit'"):
        pool.alloc(4 * MiB)
    for p in live:
        pool.free(p)


def test_a_request_beyond_any_device_is_refused_outright(sim):
    pool = sim()
    with pytest.raises(mempool.OutOfMemoryError,
                       match=r"tried to allocate 8388608.00 TiB .* refused by the largest "
                             r"request accepted \(4194304.00 TiB\).*Hint: reduce the request\."):
        pool.alloc(1 << 63)
    assert counters(pool)["num_ooms"] == 1 and counters(pool)["num_alloc_retries"] == 0
    assert pool.device.counters()["failed"] == 0     # the device was never asked
    with pytest.raises(ValueError, match="below 2\\*\\*64"):
        pool.alloc(1 << 64)                  # not a size at all: no OOM counted
    assert counters(pool)["num_ooms"] == 1


# --------------------------------------------------------------------------- after the error


def test_the_pool_is_unchanged_after_an_out_of_memory_error(host):
    # Real memory: fill the live blocks, fail an allocation, check nothing moved or changed.
    pool = host(capacity="64MiB")
    ptrs = [pool.alloc(n) for n in (1000, 3 * MiB, 12 * MiB)]
    for i, p in enumerate(ptrs):
        ctypes.memset(p, 0x41 + i, pool.block_info(p)[0])
    before_live = live_blocks(pool)
    before = pool.stats()
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(40 * MiB)
    assert live_blocks(pool) == before_live
    after = pool.stats()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"num_alloc_retries", "num_ooms"}
    for i, p in enumerate(ptrs):
        n = pool.block_info(p)[0]
        assert ctypes.string_at(p, n) == bytes([0x41 + i]) * n
    q = pool.alloc(40 * MiB)                 # fits the device: succeeds
    ctypes.memset(q, 0x7A, 40 * MiB)
    for p in ptrs + [q]:
        pool.free(p)


@pytest.mark.parametrize("how", ["injected", "device", "limit", "huge"])
def test_every_kind_of_out_of_memory_leaves_the_pool_usable(sim, how):
    pool = sim(capacity="64MiB", limit="48MiB" if how == "limit" else None)
    keep = pool.alloc(8 * MiB)               # a 20 MiB segment, 12 MiB of it free
    pool.free(pool.alloc(MiB))               # an idle 2 MiB small segment
    request = {"injected": 16 * MiB, "device": 60 * MiB, "limit": 42 * MiB, "huge": 1 << 62}[how]
    for _ in range(3):                       # repeatedly: nothing accumulates
        if how == "injected":
            pool.device.fail_next(3)
        with pytest.raises(mempool.OutOfMemoryError):
            pool.alloc(request)
    assert pool.stats()["num_ooms"] == 3
    assert pool.block_info(keep) == (8 * MiB, 8 * MiB, 0)
    pool.check_invariants()
    # What fits still fits, up to the last byte the device (and limit) allows.
    top = (48 if how == "limit" else 64) * MiB - pool.reserved_bytes()
    fill = pool.alloc(top)
    assert pool.reserved_bytes() == (48 if how == "limit" else 64) * MiB
    pool.free(fill)
    pool.free(keep)


def test_an_out_of_memory_error_is_traced_with_the_free_device_memory(sim):
    pool = sim(capacity="100MiB")
    pool.record_history(enabled=True, max_entries=16)
    a = pool.alloc(30 * MiB)
    pool.device.fail_next(3)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(5000, S1)
    action, free_bytes, nbytes, stream, _ = pool.history()[-1]
    assert (action, free_bytes, nbytes, stream) == ("oom", 70 * MiB, 5000, S1)
    oom = pool.snapshot()["device_traces"][0][-1]
    assert {k: oom[k] for k in ("action", "device_free", "size", "stream")} == \
        {"action": "oom", "device_free": 70 * MiB, "size": 5000, "stream": S1}
    assert "addr" not in oom
    pool.free(a)


def test_injected_map_failures_are_absorbed_with_expandable_segments(sim):
    pool = sim(expandable_segments=True)
    pool.device.fail_next(1)
    ptr = pool.alloc(4 * MiB)
    assert ptr == BASE and pool.stats()["num_alloc_retries"] == 1
    pool.free(ptr)
