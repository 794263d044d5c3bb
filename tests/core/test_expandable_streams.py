"""The stream contract with expandable segments, on the simulated device.

Each stream grows a range of its own. A block freed on stream S serves S again at once; another
stream takes it only through an event it waits on (cross_stream_reuse) and then owns just the
part it took; record_stream keeps a block from everyone until the recorded stream's work is
done. Pages are unmapped only after the streams that freed them are synchronized.
"""
from _support import BASE, GiB, MiB

FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3
S, T, U = 11, 22, 33


def blocks(pool, index=0):
    seg = pool.layout()[index]
    return [(b["address"] - seg["address"], b["size"], b["state"], b["stream"])
            for b in seg["blocks"] if b["state"] != UNMAPPED]


def test_a_block_freed_on_its_stream_serves_it_again_at_once(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(6 * MiB, stream=S)
    pool.device.launch(S)                                # work using a, still queued
    pool.free(a)
    assert pool.alloc(6 * MiB, stream=S) == a
    assert pool.device.counters()["syncs"] == 0 and pool.stats()["num_event_waits"] == 0
    pool.free(a)


def test_another_stream_takes_a_free_block_through_an_event_wait(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(8 * MiB, stream=S)
    seq = pool.device.launch(S)
    pool.free(a)
    b = pool.alloc(4 * MiB, stream=T)                    # taken from S's range ...
    assert b == a and pool.device.ordered(T, S, seq)     # ... ordered after S's work
    assert pool.device.counters()["syncs"] == 0
    assert pool.stats()["num_cross_stream_reuse"] == 1
    assert blocks(pool) == [(0, 4 * MiB, ALLOCATED, T), (4 * MiB, 4 * MiB, FREE, S)]
    assert len(pool.layout()) == 1                       # T reserved no range of its own
    pool.free(b)


def test_a_taken_block_merges_only_with_its_new_owners_blocks(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    pool.free(pool.alloc(8 * MiB, stream=S))
    b = pool.alloc(4 * MiB, stream=T)
    pool.free(b)                                         # T's now, beside S's remainder
    assert blocks(pool) == [(0, 4 * MiB, FREE, T), (4 * MiB, 4 * MiB, FREE, S)]
    c = pool.alloc(8 * MiB, stream=S)                    # S's 4 free MiB + 4 mapped after them
    assert c == BASE + 4 * MiB
    assert blocks(pool) == [(0, 4 * MiB, FREE, T), (4 * MiB, 8 * MiB, ALLOCATED, S)]
    assert pool.reserved_bytes() == 12 * MiB
    pool.free(c)


def test_without_cross_stream_reuse_each_stream_grows_its_own_range(sim):
    pool = sim(expandable_segments=True, capacity=GiB, cross_stream_reuse=False)
    a = pool.alloc(8 * MiB, stream=S)
    pool.device.launch(S)
    pool.free(a)
    b = pool.alloc(8 * MiB, stream=T)
    assert b == BASE + GiB                               # T's own range
    assert pool.reserved_bytes() == 16 * MiB
    assert pool.stats()["num_event_waits"] == 0
    pool.free(b)


def test_record_stream_keeps_a_block_from_everyone_until_that_stream_is_done(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(6 * MiB, stream=S)
    pool.record_stream(a, U)
    seq = pool.device.launch(U)
    pool.free(a)
    b = pool.alloc(6 * MiB, stream=S)                    # not a: U may still be using it
    c = pool.alloc(6 * MiB, stream=T)
    assert a not in (b, c)
    assert blocks(pool)[0] == (0, 6 * MiB, PENDING, S)
    pool.device.complete(U)
    assert pool.device.stream_info(U)["completed"] == seq
    d = pool.alloc(6 * MiB, stream=S)                    # now it is back
    assert d == a
    for p in (b, c, d):
        pool.free(p)


def test_pages_freed_on_another_stream_go_after_syncing_that_stream(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(8 * MiB, stream=S)
    pool.device.launch(S)
    pool.device.launch(T)                                # T used a last
    pool.free(a, stream=T)                               # T's once S's work is done too
    assert blocks(pool) == [(0, 8 * MiB, PENDING, T)]
    pool.empty_cache()                                   # syncs S (the pending free), then T
    assert pool.reserved_bytes() == 0
    t, s = pool.device.stream_info(T), pool.device.stream_info(S)
    assert t["completed"] == t["submitted"] and s["completed"] == s["submitted"]
    assert pool.device.counters()["syncs"] == 2


def test_released_pages_come_back_as_new_memory_for_their_range(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(8 * MiB, stream=S)
    keep = pool.alloc(2 * MiB, stream=S)
    pool.device.launch(S)
    pool.free(a)
    pool.empty_cache()                                   # S synced, [0, 8) unmapped
    seq = pool.device.launch(S)
    b = pool.alloc(8 * MiB, stream=T)                    # nothing free to take: T's range
    assert b == BASE + GiB and pool.stats()["num_event_waits"] == 0
    c = pool.alloc(8 * MiB, stream=S)                    # S maps its hole again
    assert c == BASE and pool.device.counters()["maps"] == 4
    assert not pool.device.ordered(T, S, seq)            # no order was needed: fresh pages
    for p in (b, c, keep):
        pool.free(p)


def test_concurrent_streams_never_share_live_bytes(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    live = {}
    for i in range(200):
        stream = (S, T, U)[i % 3]
        ptr = pool.alloc((i % 7 + 1) * 700_000, stream=stream)
        size = pool.block_info(ptr)[0]
        for q, n in live.items():
            assert ptr + size <= q or q + n <= ptr
        live[ptr] = size
        pool.device.launch(stream)
        if i % 3 == 2:
            victim = sorted(live)[i % len(live)]
            del live[victim]
            pool.free(victim)
        if i % 50 == 49:
            pool.empty_cache()
        pool.check_invariants()
    for ptr in live:
        pool.free(ptr)
    pool.device.complete_all()
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and pool.device.counters()["errors"] == 0


def test_pages_taken_through_an_event_wait_go_after_the_work_that_was_waited_for(sim):
    pool = sim(expandable_segments=True, capacity=GiB, granularity=MiB)
    a = pool.alloc(512)                                  # stream 0's small range, one page
    seq = pool.device.launch(0)
    pool.free(a)
    b = pool.alloc(MiB, stream=T)                        # the whole page, after an event wait
    assert b == a and pool.device.ordered(T, 0, seq)
    pool.free(b)                                         # T's now; T itself launched nothing
    pool.empty_cache()                                   # syncing T waits for 0's work too
    assert pool.reserved_bytes() == 0
    assert pool.device.stream_info(0)["completed"] == seq
