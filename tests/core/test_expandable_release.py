"""Releasing the pages of expandable segments, exactly, on the simulated device.

Release unmaps whole free pages only (whole physical allocations: the tests that place pages
exactly map one per page, PAGEWISE), and only after synchronizing the streams that freed
them (an unmap does not wait for queued work): device.counters()["syncs"] and
device.stream_info() show which streams were synchronized. empty_cache, trim,
release_threshold, limit and garbage_collection_threshold all go through it; a map that
fails part-way is undone by the device and leaves the pool as it was.
"""
import pytest

import mempool

from _support import BASE, GiB, MiB

FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3
# One physical allocation per page (max_map_size = the page), so that a release may take any
# whole page: the tests that pin where pages go inside a free run use it. By default a growth
# is one allocation, released only whole (Note [Growth extents]; tests/core/test_expandable_maps.py).
PAGEWISE = dict(max_map_size=2 * MiB)
S, T, U = 11, 22, 33


def layout(pool, index=0):
    seg = pool.layout()[index]
    return [(b["address"] - seg["address"], b["size"], b["state"]) for b in seg["blocks"]]


def mapped(pool):
    lay = pool.layout()
    by_blocks = sum(b["size"] for s in lay for b in s["blocks"] if b["state"] != UNMAPPED)
    assert by_blocks == pool.reserved_bytes() == pool.stats()["mapped_bytes.current"]
    assert by_blocks == pool.device.counters()["mapped_bytes"] == pool.device.used_bytes
    return by_blocks


def synced(pool, stream):
    info = pool.device.stream_info(stream)
    return info["completed"] == info["submitted"]


def counters(pool, *keys):
    c = pool.device.counters()
    return tuple(c[k] for k in keys)


# ------------------------------------------------------------------------ empty_cache, trim


def test_empty_cache_unmaps_whole_free_pages_after_syncing_their_stream(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(3 * MiB, stream=S)                    # [0, 3)
    b = pool.alloc(3 * MiB, stream=S)                    # [3, 6)
    pool.device.launch(S)                                # work on b still queued
    pool.free(b)
    pool.empty_cache()
    assert layout(pool) == [(0, 3 * MiB, ALLOCATED), (3 * MiB, MiB, FREE),
                            (4 * MiB, GiB - 4 * MiB, UNMAPPED)]
    assert mapped(pool) == 4 * MiB                       # [3, 4) shares a's page: it stays
    assert counters(pool, "syncs", "unmaps") == (1, 1)
    assert synced(pool, S)
    pool.free(a)


def test_release_syncs_only_the_streams_whose_pages_go(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(4 * MiB, stream=S)
    b = pool.alloc(4 * MiB, stream=T)
    pool.device.launch(S)
    pool.device.launch(T)
    pool.free(a)
    pool.empty_cache()
    assert synced(pool, S) and not synced(pool, T)
    assert counters(pool, "syncs", "unmaps") == (1, 1)
    assert mapped(pool) == 4 * MiB
    pool.free(b)


def test_a_page_shared_by_free_blocks_of_two_streams_goes_after_both_syncs(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    x = pool.alloc(3 * MiB, stream=S)                    # [0, 3); [3, 4) stays free, S's
    pool.device.launch(S)
    pool.device.launch(T)
    pool.free(x, stream=T)                               # last used on T: T's once S's
    assert layout(pool)[:2] == [(0, 3 * MiB, PENDING), (3 * MiB, MiB, FREE)]  # work is done
    pool.empty_cache()             # syncs S for the pending free; page [2, 4) is then free on
    assert mapped(pool) == 0       # both sides, and goes after syncing both owners
    assert synced(pool, S) and synced(pool, T)
    assert counters(pool, "syncs", "unmaps") == (3, 1)


def test_trim_releases_just_enough_from_the_high_end(sim):
    pool = sim(expandable_segments=True, **PAGEWISE, capacity=GiB)
    a = pool.alloc(20 * MiB)
    b = pool.alloc(2 * MiB)
    pool.free(a)
    pool.trim(15 * MiB)                                  # 5 MiB over: three pages go
    assert layout(pool) == [(0, 14 * MiB, FREE), (14 * MiB, 6 * MiB, UNMAPPED),
                            (20 * MiB, 2 * MiB, ALLOCATED), (22 * MiB, GiB - 22 * MiB, UNMAPPED)]
    assert pool.cached_bytes() == 14 * MiB and mapped(pool) == 16 * MiB
    pool.trim(15 * MiB)                                  # already under: nothing happens
    assert counters(pool, "syncs", "unmaps") == (1, 1)
    pool.free(b)


def test_trim_takes_the_largest_free_run_first(sim):
    pool = sim(expandable_segments=True, **PAGEWISE, capacity=GiB)
    a, keep1, b, keep2 = (pool.alloc(n * MiB) for n in (6, 2, 10, 2))   # [0,6) [6,8) [8,18) [18,20)
    pool.free(a)
    pool.free(b)
    pool.trim(10 * MiB)                                  # 16 cached: 6 MiB go, all from b
    assert layout(pool)[:4] == [(0, 6 * MiB, FREE), (6 * MiB, 2 * MiB, ALLOCATED),
                                (8 * MiB, 4 * MiB, FREE), (12 * MiB, 6 * MiB, UNMAPPED)]
    assert mapped(pool) == 14 * MiB
    pool.free(keep1)
    pool.free(keep2)


def test_pending_frees_keep_their_pages_until_their_streams_are_done(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(8 * MiB)
    pool.record_stream(a, U)
    pool.device.launch(U)
    pool.free(a)                                         # pending on U
    pool.trim(0)                                         # trim does not wait: nothing goes
    assert mapped(pool) == 8 * MiB and layout(pool)[0] == (0, 8 * MiB, PENDING)
    assert counters(pool, "syncs", "unmaps") == (0, 0)
    pool.empty_cache()                                   # waits for U, then releases
    assert synced(pool, U) and mapped(pool) == 0


# ------------------------------------------------------------------------ retention options


def test_release_threshold_keeps_at_most_that_much_mapped_and_free(sim):
    pool = sim(expandable_segments=True, **PAGEWISE, capacity=GiB, release_threshold=4 * MiB)
    a = pool.alloc(10 * MiB)
    b = pool.alloc(2 * MiB)
    pool.free(a)                                         # 10 MiB cached: 6 MiB over
    assert layout(pool)[:3] == [(0, 4 * MiB, FREE), (4 * MiB, 6 * MiB, UNMAPPED),
                                (10 * MiB, 2 * MiB, ALLOCATED)]
    assert pool.cached_bytes() == 4 * MiB and mapped(pool) == 6 * MiB
    c = pool.alloc(8 * MiB)                              # the 4 free MiB + 4 MiB of the hole
    assert c == BASE and mapped(pool) == 10 * MiB
    pool.set_release_threshold(0)
    pool.free(c)                                         # all of [0, 10) goes; b stays
    assert mapped(pool) == 2 * MiB
    # Note [Threshold releases without a sync]: the stream had no work queued, so a query
    # said so and nothing was synchronized.
    assert counters(pool, "syncs", "unmaps") == (0, 2)
    assert counters(pool, "stream_queries")[0] >= 2
    pool.free(b)
    assert mapped(pool) == 0


def test_release_threshold_leaves_a_busy_streams_pages_until_it_is_idle(sim):
    pool = sim(expandable_segments=True, capacity=GiB, release_threshold=0)
    a = pool.alloc(8 * MiB, stream=S)
    pool.device.launch(S)                                # work on a still queued
    pool.free(a)
    assert mapped(pool) == 8 * MiB and pool.cached_bytes() == 8 * MiB
    keep = pool.alloc(512, stream=T)                     # T's page is never wholly free
    # While S stays busy, the checks back off: a query at most every 64th operation after
    # the first few, not one at every alloc and free.
    for _ in range(200):
        pool.free(pool.alloc(512, stream=T))
    assert counters(pool, "syncs") == (0,)
    assert counters(pool, "stream_queries")[0] <= 30
    assert mapped(pool) >= 8 * MiB and synced(pool, S) is False
    pool.device.complete(S)
    for _ in range(65):                                  # the next attempt finds S idle
        pool.free(pool.alloc(512, stream=T))
        if mapped(pool) < 8 * MiB:
            break
    assert mapped(pool) == pool.reserved_bytes() < 8 * MiB   # S's pages went; T's stays
    pool.free(keep)
    assert mapped(pool) == 0
    assert counters(pool, "syncs") == (0,)
    pool.check_invariants()


def test_a_stream_waiting_on_busy_work_is_busy_to_a_threshold_release(sim):
    """A stream's wait on another stream's event is work of the stream, as in CUDA: its
    pages stay until what it waits for is done."""
    pool = sim(expandable_segments=True, capacity=GiB, release_threshold=0)
    a = pool.alloc(4 * MiB, stream=T)
    pool.device.launch(T)
    pool.free(a)                                         # T busy: a's pages stay
    b = pool.alloc(4 * MiB, stream=S)                    # taken across: S waits on T
    assert b == a and pool.stats()["num_event_waits"] == 1
    pool.free(b)                                         # now S's, behind its wait on T
    pool.set_release_threshold(0)                        # checked at once, no back-off
    assert mapped(pool) == 4 * MiB
    assert counters(pool, "syncs") == (0,)
    pool.device.complete(S)                              # S's wait completes T's work too
    assert synced(pool, T)
    pool.set_release_threshold(0)
    assert mapped(pool) == 0 and counters(pool, "syncs") == (0,)
    pool.check_invariants()


def test_limit_reclaims_free_pages_before_refusing(sim):
    pool = sim(expandable_segments=True, capacity=GiB, limit=10 * MiB)
    a = pool.alloc(4 * MiB)                              # [0, 4)
    b = pool.alloc(4 * MiB)                              # [4, 8)
    pool.free(a)
    c = pool.alloc(6 * MiB)                              # 8 + 6 > 10: a's pages go first
    assert c == BASE + 8 * MiB
    assert mapped(pool) == 10 * MiB
    # under a limit, one allocation per page (Note [Growth extents]): 2 + 2 + 3 maps
    assert counters(pool, "maps", "unmaps", "syncs") == (7, 1, 1)
    assert layout(pool)[:3] == [(0, 4 * MiB, UNMAPPED), (4 * MiB, 4 * MiB, ALLOCATED),
                                (8 * MiB, 6 * MiB, ALLOCATED)]
    before = layout(pool)
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 10.00 MiB \(10,485,760 bytes\)"):
        pool.alloc(2 * MiB)                              # nothing free left to give
    assert layout(pool) == before and mapped(pool) == 10 * MiB
    pool.set_limit(12 * MiB)
    d = pool.alloc(2 * MiB)                              # the hole is the lowest fit
    assert d == BASE and mapped(pool) == 12 * MiB
    for p in (b, c, d):
        pool.free(p)


def test_a_free_block_that_fits_needs_no_release_under_the_limit(sim):
    pool = sim(expandable_segments=True, capacity=GiB, limit=16 * MiB)
    a = pool.alloc(8 * MiB)
    b = pool.alloc(8 * MiB)
    pool.free(a)
    c = pool.alloc(8 * MiB)                              # reuses a: no release needed
    assert c == BASE and counters(pool, "unmaps") == (0,)
    pool.free(b)
    pool.free(c)
    assert mapped(pool) == 16 * MiB <= pool.options["limit"]


def test_garbage_collection_releases_down_to_the_threshold_before_growing(sim):
    pool = sim(expandable_segments=True, **PAGEWISE, capacity=100 * MiB,
               garbage_collection_threshold=0.5)
    a = pool.alloc(30 * MiB)                             # [0, 30)
    b = pool.alloc(10 * MiB)                             # [30, 40)
    pool.free(a)
    c = pool.alloc(32 * MiB)                             # 40 + 32 > 50: 22 MiB of a go first
    assert c == BASE + 40 * MiB
    assert mapped(pool) == 50 * MiB
    assert layout(pool)[:4] == [(0, 8 * MiB, FREE), (8 * MiB, 22 * MiB, UNMAPPED),
                                (30 * MiB, 10 * MiB, ALLOCATED), (40 * MiB, 32 * MiB, ALLOCATED)]
    assert counters(pool, "syncs", "unmaps") == (1, 1)
    d = pool.alloc(20 * MiB)                             # joins the 8 free MiB; nothing else
    assert d == BASE and mapped(pool) == 62 * MiB        # to give: over it, as best effort
    for p in (b, c, d):
        pool.free(p)


def test_garbage_collection_threshold_follows_the_limit(sim):
    pool = sim(expandable_segments=True, capacity=GiB, limit=40 * MiB,
               garbage_collection_threshold=0.5)          # 20 MiB
    a = pool.alloc(16 * MiB)
    b = pool.alloc(2 * MiB)
    pool.free(a)
    c = pool.alloc(18 * MiB)                             # 18 + 18 > 20: 16 MiB of a go
    assert mapped(pool) == 20 * MiB and c == BASE + 18 * MiB
    pool.free(b)
    pool.free(c)


def test_initial_pool_size_is_mapped_at_the_start_and_stays(sim):
    pool = sim(expandable_segments=True, capacity=GiB, initial_pool_size=5 * MiB)
    assert mapped(pool) == 6 * MiB                       # whole pages
    (seg,) = pool.layout()
    assert seg["is_expandable"] and seg["is_pinned"] and seg["address"] == BASE
    a = pool.alloc(4 * MiB)
    assert a == BASE and counters(pool, "maps") == (1,)
    pool.free(a)
    b = pool.alloc(10 * MiB)                             # grows on from the pinned pages
    assert b == BASE and mapped(pool) == 10 * MiB
    pool.free(b)
    pool.empty_cache()                                   # only the pages past the pin go
    assert mapped(pool) == 6 * MiB
    assert layout(pool) == [(0, 6 * MiB, FREE), (6 * MiB, GiB - 6 * MiB, UNMAPPED)]


def test_initial_pool_size_that_whole_pages_cannot_hold_fails_clearly():
    with pytest.raises(mempool.OutOfMemoryError, match=r"initial_pool_size of 5.00 MiB \(5,242,880 bytes\)"):
        mempool.Pool(backend="sim", expandable_segments=True, capacity=5 * MiB,
                     initial_pool_size=5 * MiB)           # three 2 MiB pages on a 5 MiB device


# ------------------------------------------------------------------------ failures


def test_a_map_that_fails_part_way_is_undone_and_retried(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    pool.device.fail_map_after(2)                        # 2 of 4 pages, then out of memory
    a = pool.alloc(8 * MiB)
    assert a == BASE
    assert counters(pool, "maps", "failed", "errors") == (1, 1, 0)
    assert mapped(pool) == 8 * MiB
    assert pool.stats()["num_alloc_retries"] == 1
    pool.free(a)


def test_a_growth_that_keeps_failing_leaves_the_pool_as_it_was(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    pool.free(pool.alloc(3 * MiB))                       # [0, 4) free, mapped
    before = layout(pool)
    pool.device.fail_next(2)                             # the map and its retry
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(9 * MiB)                              # would join [0, 4) and map [4, 10)
    assert layout(pool) == before and mapped(pool) == 4 * MiB
    assert counters(pool, "failed", "errors") == (2, 0)
    a = pool.alloc(9 * MiB)                              # usable, in the same place
    assert a == BASE and mapped(pool) == 10 * MiB
    pool.free(a)


def test_a_map_that_runs_out_of_device_memory_part_way_is_undone(sim):
    pool = sim(expandable_segments=True, capacity=12 * MiB)
    held = pool.alloc(4 * MiB, stream=S)                 # S's range: 4 MiB of the device
    pool.free(pool.alloc(3 * MiB))                       # stream 0's: [0, 4) free, mapped
    before = pool.layout()
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(9 * MiB)                              # 3 more pages: the device has 2
    assert pool.layout() == before and mapped(pool) == 8 * MiB
    assert counters(pool, "maps", "failed", "errors") == (2, 2, 0)   # a try and a retry
    a = pool.alloc(7 * MiB)                              # 2 pages fit
    assert a == BASE + 12 * MiB and mapped(pool) == 12 * MiB
    pool.free(a)
    pool.free(held)


def test_out_of_device_memory_releases_free_pages_of_other_ranges(sim):
    pool = sim(expandable_segments=True, capacity=16 * MiB)
    pool.device.launch(S)
    pool.free(pool.alloc(8 * MiB, stream=S))             # S's range holds 8 idle MiB
    b = pool.alloc(12 * MiB)                             # 8 + 12 > 16 on the device
    assert b == BASE + 16 * MiB                          # stream 0's range, the second
    assert mapped(pool) == 12 * MiB
    assert counters(pool, "failed", "syncs", "unmaps") == (1, 1, 1)
    assert synced(pool, S)
    assert pool.stats()["num_alloc_retries"] == 1
    pool.free(b)


# ------------------------------------------------------------------------ the high-water rule


def test_growth_past_the_high_water_mark_first_moves_idle_pages(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(64 * MiB)                             # [0, 64)
    b = pool.alloc(64 * MiB)                             # [64, 128): the mark is 128 MiB
    pool.free(a)
    c = pool.alloc(100 * MiB)                            # a's 64 idle MiB go before growing
    assert c == BASE + 128 * MiB
    assert mapped(pool) == 164 * MiB                     # not 228
    assert pool.stats()["reserved_bytes.all.peak"] == 164 * MiB
    assert counters(pool, "syncs", "unmaps") == (1, 1)
    pool.free(c)
    d = pool.alloc(150 * MiB)                            # joins c's free block: nothing idle
    assert d == BASE + 128 * MiB and counters(pool, "syncs") == (1,)
    pool.free(b)
    pool.free(d)


def test_the_high_water_rule_leaves_small_idle_amounts_alone(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(16 * MiB)
    b = pool.alloc(16 * MiB)
    pool.free(a)                                         # 16 MiB idle: below 32 MiB
    c = pool.alloc(20 * MiB)
    assert mapped(pool) == 52 * MiB and counters(pool, "syncs") == (0,)
    for p in (b, c):
        pool.free(p)


def test_the_high_water_mark_is_not_reset_with_the_peak_stats(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a, b, c = (pool.alloc(n * MiB) for n in (64, 64, 80))   # the mark: 208 MiB
    pool.free(a)
    pool.free(c)
    pool.trim(64 * MiB)                                  # the larger run (c's) goes
    assert mapped(pool) == 128 * MiB
    pool.reset_peak_stats()                              # the stats' peak is now 128 MiB
    d = pool.alloc(70 * MiB)                             # 198 MiB, still under the mark:
    assert d == BASE + 128 * MiB                         # a's idle 64 MiB stay mapped
    assert mapped(pool) == 198 * MiB and counters(pool, "syncs") == (1,)
    for p in (b, d):
        pool.free(p)
