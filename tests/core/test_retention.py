"""Retention: release_threshold, limit, initial_pool_size, garbage_collection_threshold,
empty_cache() and trim(keep), on the simulated device with exact figures.

The simulated device hands out addresses from BASE upwards and never reuses one, so a
segment's address says which upstream allocation it is: a fresh address means the pool
went upstream, an old one means it reused its cache. Requests above 10 MiB get a segment
of exactly their size (rounded to 2 MiB), which keeps the arithmetic readable.
"""
import pytest

import mempool
from _support import BASE, MiB
from _support import device_counters as device, stat_subset as counters

S1, S2, S3 = 7, 9, 11   # stream handles (the sim accepts any integer)


def segments(pool):
    """[(offset from BASE, total_size, pinned)] of every segment, in address order."""
    return [(s["address"] - BASE, s["total_size"], s["is_pinned"]) for s in pool.layout()]


def figures(pool):
    return {"reserved": pool.reserved_bytes(), "cached": pool.cached_bytes(),
            "used": pool.used_bytes()}


def three_idle_segments(pool, sizes=(12, 14, 16)):
    """Allocate one segment per size (MiB), then free them in that order (the first freed
    has gone unused longest). Returns their offsets from BASE."""
    ptrs = [pool.alloc(n * MiB) for n in sizes]
    for p in ptrs:
        pool.free(p)
    return [p - BASE for p in ptrs]


# --------------------------------------------------------------------------- release_threshold


def test_without_release_threshold_every_freed_segment_is_kept(sim):
    pool = sim()
    assert pool.options["release_threshold"] is None
    three_idle_segments(pool)
    assert figures(pool) == {"reserved": 42 * MiB, "cached": 42 * MiB, "used": 0}
    assert device(pool, "allocs", "frees", "live_segments") == \
        {"allocs": 3, "frees": 0, "live_segments": 3}
    # The cache serves the next requests: no new upstream allocation.
    ptr = pool.alloc(14 * MiB)
    assert ptr == BASE + 12 * MiB
    assert pool.device.counters()["allocs"] == 3
    pool.free(ptr)


def test_release_threshold_returns_the_segment_idle_longest_first(sim):
    pool = sim(release_threshold="30MiB")
    a, b, c = (pool.alloc(12 * MiB) for _ in range(3))
    assert (a, b, c) == (BASE, BASE + 12 * MiB, BASE + 24 * MiB)
    pool.free(b)
    pool.free(a)
    # 24 MiB cached: within the threshold, nothing goes back.
    assert figures(pool) == {"reserved": 36 * MiB, "cached": 24 * MiB, "used": 12 * MiB}
    assert pool.device.counters()["frees"] == 0
    pool.free(c)
    # 36 MiB cached > 30 MiB: b, idle longest (freed first), goes back, though a is older.
    assert segments(pool) == [(0, 12 * MiB, False), (24 * MiB, 12 * MiB, False)]
    assert figures(pool) == {"reserved": 24 * MiB, "cached": 24 * MiB, "used": 0}
    assert device(pool, "allocs", "frees", "live_segments") == \
        {"allocs": 3, "frees": 1, "live_segments": 2}
    assert counters(pool, "num_device_alloc", "num_device_free", "segment.all.current") == \
        {"num_device_alloc": 3, "num_device_free": 1, "segment.all.current": 2}


def test_release_threshold_zero_returns_every_segment_once_idle(sim):
    pool = sim(release_threshold=0)
    a = pool.alloc(2 * MiB)                 # a 20 MiB segment; 18 MiB of it free
    # Free memory of a segment in use cannot go back: it stays cached.
    assert figures(pool) == {"reserved": 20 * MiB, "cached": 18 * MiB, "used": 2 * MiB}
    pool.free(a)
    assert figures(pool) == {"reserved": 0, "cached": 0, "used": 0}
    assert device(pool, "allocs", "frees", "live_segments") == \
        {"allocs": 1, "frees": 1, "live_segments": 0}
    # The next request goes upstream again: a fresh address.
    b = pool.alloc(2 * MiB)
    assert b == BASE + 20 * MiB
    assert pool.device.counters()["allocs"] == 2
    pool.free(b)


def test_release_threshold_is_checked_after_an_allocation_too(sim):
    pool = sim(release_threshold="20MiB", cross_stream_reuse=False)
    pool.free(pool.alloc(12 * MiB, S1))      # 12 MiB cached: kept
    assert segments(pool) == [(0, 12 * MiB, False)]
    # S2 may not take S1's block: a new 20 MiB segment, 18 MiB of it left free, so
    # 12 + 18 MiB are cached after the allocation: the idle 12 MiB segment goes.
    x = pool.alloc(2 * MiB, S2)
    assert x == BASE + 12 * MiB
    assert segments(pool) == [(12 * MiB, 20 * MiB, False)]
    assert figures(pool) == {"reserved": 20 * MiB, "cached": 18 * MiB, "used": 2 * MiB}
    pool.free(x)                              # exactly the threshold cached: kept
    assert figures(pool) == {"reserved": 20 * MiB, "cached": 20 * MiB, "used": 0}
    assert device(pool, "allocs", "frees") == {"allocs": 2, "frees": 1}


def test_set_release_threshold_applies_at_once_and_refuses_bad_values(sim):
    pool = sim()
    three_idle_segments(pool)
    with pytest.raises(ValueError, match="release_threshold.*'lots'"):
        pool.set_release_threshold("lots")
    assert pool.options["release_threshold"] is None and pool.reserved_bytes() == 42 * MiB
    pool.set_release_threshold("16MiB")
    # 42 MiB cached: the 12 and 14 MiB segments (idle longest) go; 16 MiB stays.
    assert segments(pool) == [(26 * MiB, 16 * MiB, False)]
    pool.set_release_threshold(None)
    ptr = pool.alloc(20 * MiB)   # below the 42 MiB once reserved (Note [Reserved high water])
    pool.free(ptr)
    assert figures(pool)["cached"] == 36 * MiB   # None: keep all again


# --------------------------------------------------------------------------- limit


def test_limit_releases_idle_segments_before_growing_past_it(sim):
    pool = sim(limit="40MiB")
    three_idle_segments(pool, (12, 14))     # 26 MiB reserved, all cached
    c = pool.alloc(20 * MiB)
    # 26 + 20 > 40: the 12 MiB segment (idle longest) goes first; 14 + 20 = 34 fits.
    assert c == BASE + 26 * MiB
    assert segments(pool) == [(12 * MiB, 14 * MiB, False), (26 * MiB, 20 * MiB, False)]
    assert figures(pool) == {"reserved": 34 * MiB, "cached": 14 * MiB, "used": 20 * MiB}
    assert device(pool, "allocs", "frees") == {"allocs": 3, "frees": 1}
    # Making room under the limit is no retry and no OOM.
    assert counters(pool, "num_alloc_retries", "num_ooms") == \
        {"num_alloc_retries": 0, "num_ooms": 0}
    pool.free(c)


def test_limit_fails_with_out_of_memory_when_releasing_cannot_make_room(sim):
    pool = sim(limit="40MiB")
    a = pool.alloc(24 * MiB)
    pool.free(pool.alloc(12 * MiB))         # an idle 12 MiB segment
    with pytest.raises(mempool.OutOfMemoryError) as err:
        pool.alloc(20 * MiB)                 # 24 live + 20 > 40 whatever is released
    msg = str(err.value)
    assert "tried to allocate 20.00 MiB (20,971,520 bytes), rounded to 20.00 MiB" in msg
    assert "refused by the pool's limit of 40.00 MiB (41,943,040 bytes)" in msg
    # The cache was released trying (as PyTorch's allocator does); the live block stays.
    assert "24.00 MiB reserved, 24.00 MiB used, 0 bytes cached" in msg
    assert segments(pool) == [(0, 24 * MiB, False)]
    assert pool.block_info(a) == (24 * MiB, 24 * MiB, 0)
    assert device(pool, "allocs", "frees", "failed") == {"allocs": 2, "frees": 1, "failed": 0}
    assert counters(pool, "num_ooms", "num_alloc_retries") == \
        {"num_ooms": 1, "num_alloc_retries": 0}
    # Up to the limit exactly still works.
    b = pool.alloc(16 * MiB)
    assert b == BASE + 36 * MiB and pool.reserved_bytes() == 40 * MiB
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 40.00 MiB \(41,943,040 bytes\)"):
        pool.alloc(512)                      # a new 2 MiB small segment would pass it
    pool.free(a)
    pool.free(b)


def test_limit_as_a_fraction_of_capacity(sim):
    pool = sim(capacity="100MiB", limit=0.5)
    assert pool.options["limit"] == 50 * MiB
    a = pool.alloc(50 * MiB)
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 50.00 MiB \(52,428,800 bytes\)"):
        pool.alloc(1)
    pool.free(a)
    conf = mempool.Pool.from_conf("backend:sim,capacity:100MiB,limit:0.25")
    assert conf.options["limit"] == 25 * MiB


def test_set_limit_changes_the_cap_and_keeps_what_is_reserved(sim):
    pool = sim(capacity="1GiB")
    a = pool.alloc(30 * MiB)
    pool.free(pool.alloc(20 * MiB))
    pool.set_limit("40MiB")
    # Lowering the limit releases nothing by itself (as PyTorch's memory fraction).
    assert pool.reserved_bytes() == 50 * MiB and pool.options["limit"] == 40 * MiB
    b = pool.alloc(20 * MiB)                 # fits the idle 20 MiB segment: no growth
    assert b == BASE + 30 * MiB
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 40.00 MiB \(41,943,040 bytes\)"):
        pool.alloc(12 * MiB)
    pool.set_limit(0.25)                     # a quarter of 1 GiB
    assert pool.options["limit"] == 256 * MiB
    c = pool.alloc(12 * MiB)
    with pytest.raises(ValueError, match="limit"):
        pool.set_limit(1.5)
    assert pool.options["limit"] == 256 * MiB
    pool.set_limit(None)
    assert pool.options["limit"] is None
    for p in (a, b, c):
        pool.free(p)


# --------------------------------------------------------------------------- initial_pool_size


def test_initial_pool_size_is_reserved_at_start_and_serves_the_first_step(sim):
    pool = sim(initial_pool_size="64MiB")
    assert segments(pool) == [(0, 64 * MiB, True)]
    assert figures(pool) == {"reserved": 64 * MiB, "cached": 64 * MiB, "used": 0}
    assert device(pool, "allocs") == {"allocs": 1}
    for step in range(3):
        ptrs = [pool.alloc(n * MiB) for n in (10, 20, 30)]
        # Every request of the step comes out of the reserved segment: no upstream call.
        assert [p - BASE for p in ptrs] == [0, 10 * MiB, 30 * MiB]
        assert pool.device.counters()["allocs"] == 1
        for p in ptrs:
            pool.free(p)
    assert counters(pool, "num_device_alloc", "num_device_free") == \
        {"num_device_alloc": 1, "num_device_free": 0}


def test_initial_pool_size_is_kept_through_release_threshold_empty_cache_and_trim(sim):
    pool = sim(initial_pool_size="64MiB", release_threshold=0)
    big = pool.alloc(100 * MiB)              # more than the reservation: a segment of its own
    assert segments(pool) == [(0, 64 * MiB, True), (64 * MiB, 100 * MiB, False)]
    pool.free(big)                           # release_threshold 0: it goes back ...
    assert segments(pool) == [(0, 64 * MiB, True)]   # ... the reserved segment stays
    pool.empty_cache()
    pool.trim(0)
    assert segments(pool) == [(0, 64 * MiB, True)]
    assert figures(pool) == {"reserved": 64 * MiB, "cached": 64 * MiB, "used": 0}
    assert device(pool, "allocs", "frees") == {"allocs": 2, "frees": 1}


def test_initial_pool_size_rounds_up_to_2MiB(sim):
    pool = sim(initial_pool_size=3 * MiB + 1)
    assert segments(pool) == [(0, 4 * MiB, True)]


def test_initial_pool_size_is_a_large_pool_segment(sim):
    # Requests up to 1 MiB keep to small 2 MiB segments so that they never shred large
    # ones; the reservation serves requests above 1 MiB.
    pool = sim(initial_pool_size="64MiB")
    small = pool.alloc(4096)
    assert small == BASE + 64 * MiB
    assert segments(pool) == [(0, 64 * MiB, True), (64 * MiB, 2 * MiB, False)]
    pool.free(small)


def test_initial_pool_size_counts_against_limit(sim):
    pool = sim(initial_pool_size="32MiB", limit="40MiB")
    a = pool.alloc(30 * MiB)                 # from the reservation
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 40.00 MiB \(41,943,040 bytes\)"):
        pool.alloc(10 * MiB)                 # 32 + 10 > 40; the reservation is never released
    assert segments(pool) == [(0, 32 * MiB, True)]
    pool.free(a)


@pytest.mark.parametrize("options, error, fragment", [
    ({"capacity": "32MiB", "initial_pool_size": "64MiB"}, ValueError,
     r"'initial_pool_size' \(64.00 MiB \(67,108,864 bytes\)\) exceeds 'capacity' "
     r"\(32.00 MiB \(33,554,432 bytes\)\)"),
    ({"limit": "16MiB", "initial_pool_size": "32MiB"}, ValueError,
     r"'initial_pool_size' \(32.00 MiB \(33,554,432 bytes\)\) exceeds 'limit' "
     r"\(16.00 MiB \(16,777,216 bytes\)\)"),
    ({"initial_pool_size": "100GiB"}, mempool.OutOfMemoryError,
     r"initial_pool_size of 100.00 GiB \(107,374,182,400 bytes\) could not be reserved on "
     r"sim device 0 \(capacity 80.00 GiB\)"),
])
def test_initial_pool_size_that_cannot_be_reserved(options, error, fragment):
    with pytest.raises(error, match=fragment):
        mempool.Pool(backend="sim", **options)


# --------------------------------------------------------------------------- garbage collection


def test_gc_releases_the_segment_unused_longest_before_growing(sim):
    pool = sim(capacity="100MiB", garbage_collection_threshold=0.5)   # at 50 MiB
    b_first = pool.alloc(14 * MiB)
    a = pool.alloc(12 * MiB)
    c = pool.alloc(16 * MiB)
    pool.free(a)                             # a goes unused first ...
    pool.free(b_first)                       # ... then the older segment
    # 42 + 20 > 50: release 12 MiB of what has gone unused longest: a, not the older one.
    d = pool.alloc(20 * MiB)
    assert d == BASE + 42 * MiB
    assert segments(pool) == [(0, 14 * MiB, False), (26 * MiB, 16 * MiB, False),
                              (42 * MiB, 20 * MiB, False)]
    assert figures(pool) == {"reserved": 50 * MiB, "cached": 14 * MiB, "used": 36 * MiB}
    assert device(pool, "allocs", "frees", "failed") == {"allocs": 4, "frees": 1, "failed": 0}
    assert counters(pool, "num_alloc_retries", "num_ooms") == \
        {"num_alloc_retries": 0, "num_ooms": 0}
    pool.free(c)
    pool.free(d)


def test_gc_does_nothing_below_its_threshold(sim):
    pool = sim(capacity="100MiB", garbage_collection_threshold=0.5)
    three_idle_segments(pool, (12,))
    d = pool.alloc(20 * MiB)                 # 12 + 20 <= 50
    assert segments(pool) == [(0, 12 * MiB, False), (12 * MiB, 20 * MiB, False)]
    assert pool.device.counters()["frees"] == 0
    pool.free(d)


def test_gc_off_keeps_idle_segments_worth_less_than_a_new_one(sim):
    pool = sim(capacity="100MiB")
    three_idle_segments(pool, (12,))
    d = pool.alloc(20 * MiB)                 # 12 MiB idle < the 20 MiB segment: kept
    assert segments(pool) == [(0, 12 * MiB, False), (12 * MiB, 20 * MiB, False)]
    assert pool.device.counters()["frees"] == 0
    pool.free(d)


def test_idle_segments_worth_a_new_one_are_released_first_oldest_first(sim):
    pool = sim(capacity="100MiB")
    three_idle_segments(pool, (12, 14, 16))
    d = pool.alloc(20 * MiB)                 # none fits; 42 MiB idle: release 12 + 14 >= 20
    assert segments(pool) == [(26 * MiB, 16 * MiB, False), (42 * MiB, 20 * MiB, False)]
    assert device(pool, "frees") == {"frees": 2}
    assert counters(pool, "num_alloc_retries", "num_ooms") == \
        {"num_alloc_retries": 0, "num_ooms": 0}
    pool.free(d)


def test_gc_threshold_is_a_fraction_of_limit_when_a_limit_is_set(sim):
    pool = sim(capacity="1GiB", limit="80MiB", garbage_collection_threshold=0.5)  # at 40 MiB
    three_idle_segments(pool, (12, 14))
    d = pool.alloc(20 * MiB)                 # 26 + 20 > 40: the 12 MiB segment goes
    assert segments(pool) == [(12 * MiB, 14 * MiB, False), (26 * MiB, 20 * MiB, False)]
    pool.free(d)


def test_gc_ages_a_segment_from_its_last_use(sim):
    pool = sim(capacity="100MiB", garbage_collection_threshold=0.5)
    a, b = three_idle_segments(pool, (12, 14))
    pool.free(pool.alloc(12 * MiB))          # a is used again: now b has gone unused longest
    # 26 MiB idle < a 30 MiB segment, so only the collection releases: 26 + 30 > 50
    c = pool.alloc(30 * MiB)                 # 6 MiB over: the longest unused, b (14), goes
    assert segments(pool) == [(0, 12 * MiB, False), (26 * MiB, 30 * MiB, False)]
    pool.free(c)


# --------------------------------------------------------------------------- empty_cache


def test_empty_cache_releases_every_idle_segment_and_keeps_busy_ones(sim):
    pool = sim()
    three_idle_segments(pool)
    live = pool.alloc(2 * MiB)               # reuses the 12 MiB segment: it stays
    assert live == BASE
    pool.empty_cache()
    assert segments(pool) == [(0, 12 * MiB, False)]
    assert figures(pool) == {"reserved": 12 * MiB, "cached": 10 * MiB, "used": 2 * MiB}
    assert device(pool, "frees", "syncs", "live_segments") == \
        {"frees": 2, "syncs": 0, "live_segments": 1}
    assert counters(pool, "num_device_free", "num_sync_all_streams") == \
        {"num_device_free": 2, "num_sync_all_streams": 0}
    pool.free(live)
    pool.empty_cache()
    assert figures(pool) == {"reserved": 0, "cached": 0, "used": 0}


def test_empty_cache_frees_blocks_of_other_streams_after_an_event_wait_not_a_sync(sim):
    pool = sim()
    a = pool.alloc(2 * MiB, S1)
    b = pool.alloc(2 * MiB, S1)
    pool.free(a, S2)                         # a's last use is on S2: it becomes S2's
    pool.free(b)
    pool.device.launch(S2)
    pool.empty_cache()
    assert figures(pool)["reserved"] == 0
    # The segment is freed on S1 after S1 waits for S2's work: no host sync.
    assert device(pool, "frees", "syncs", "waits") == {"frees": 1, "syncs": 0, "waits": 1}
    assert pool.device.stream_info(S2)["completed"] == 0
    assert counters(pool, "num_event_waits", "num_sync_all_streams") == \
        {"num_event_waits": 1, "num_sync_all_streams": 0}


def test_empty_cache_syncs_only_the_streams_that_pending_frees_wait_on(sim):
    pool = sim()
    a = pool.alloc(12 * MiB, S1)
    pool.record_stream(a, S2)
    for s in (S1, S2, S3):
        pool.device.launch(s)
    pool.free(a)                             # pending: S2 may still use it
    assert figures(pool) == {"reserved": 12 * MiB, "cached": 0, "used": 0}
    pool.empty_cache()
    assert figures(pool) == {"reserved": 0, "cached": 0, "used": 0}
    assert pool.device.counters()["syncs"] == 1
    assert pool.device.stream_info(S2) == {"submitted": 1, "completed": 1}
    assert pool.device.stream_info(S1) == {"submitted": 1, "completed": 0}
    assert pool.device.stream_info(S3) == {"submitted": 1, "completed": 0}
    assert counters(pool, "num_sync_all_streams", "num_device_free") == \
        {"num_sync_all_streams": 1, "num_device_free": 1}


def test_empty_cache_does_not_sync_for_pending_frees_that_completed(sim):
    pool = sim()
    a = pool.alloc(12 * MiB, S1)
    pool.record_stream(a, S2)
    pool.device.launch(S2)
    pool.free(a)
    pool.device.complete(S2)                 # done meanwhile: no sync needed
    pool.empty_cache()
    assert pool.reserved_bytes() == 0
    assert pool.device.counters()["syncs"] == 0
    assert pool.stats()["num_sync_all_streams"] == 0


# --------------------------------------------------------------------------- trim


def test_trim_releases_the_segments_unused_longest_down_to_keep(sim):
    pool = sim()
    three_idle_segments(pool, (12, 14, 16, 18))          # 60 MiB cached
    pool.trim("60MiB")
    assert pool.device.counters()["frees"] == 0           # nothing above keep
    pool.trim(30 * MiB)
    # 30 MiB to release, whole segments, longest unused first: 12 + 14 < 30, + 16 >= 30.
    assert segments(pool) == [(42 * MiB, 18 * MiB, False)]
    assert figures(pool) == {"reserved": 18 * MiB, "cached": 18 * MiB, "used": 0}
    assert device(pool, "frees", "syncs") == {"frees": 3, "syncs": 0}
    pool.trim()
    assert pool.reserved_bytes() == 0


def test_trim_never_blocks_on_pending_frees(sim):
    pool = sim()
    a = pool.alloc(12 * MiB, S1)
    pool.record_stream(a, S2)
    pool.device.launch(S2)
    pool.free(a)
    pool.trim(0)
    assert segments(pool) == [(0, 12 * MiB, False)]       # still pending on S2
    assert pool.device.counters()["syncs"] == 0
    pool.device.complete(S2)
    pool.trim(0)                                           # done now: it goes
    assert segments(pool) == []


@pytest.mark.parametrize("keep, error, fragment", [
    (-1, ValueError, "negative"),
    ("lots", ValueError, "'keep': 'lots' is not valid"),
    (1.5, ValueError, "a float is not a size"),
    (None, ValueError, "'keep': None is not valid"),
])
def test_trim_refuses_a_bad_keep_and_changes_nothing(sim, keep, error, fragment):
    pool = sim()
    three_idle_segments(pool)
    with pytest.raises(error, match=fragment):
        pool.trim(keep)
    assert pool.reserved_bytes() == 42 * MiB and pool.device.counters()["frees"] == 0


# --------------------------------------------------------------------------- releases before a growth


def busy_release_then_grow(pool, stream):
    """Idle segments of 12, 14 and 16 MiB made on `stream`, then a 20 MiB request none holds,
    while `stream` still has work queued: the 12 and 14 MiB segments are released first
    (idle segments worth a new one, oldest first). Returns the new block."""
    for p in [pool.alloc(n * MiB, stream=stream) for n in (12, 14, 16)]:
        pool.free(p, stream=stream)
    pool.device.launch(stream)                       # work queued before the release's frees
    return pool.alloc(20 * MiB, stream=stream)


def test_a_growth_that_releases_waits_for_the_frees_before_allocating(sim):
    # Note [Released before a growth]: a stream-ordered free behind queued work is the
    # driver's until that work has run (Note [Frees the driver keeps], the sim's held_bytes).
    # Allocating the new segment only after the release's stream is synchronized keeps the
    # device's own count at the Pool's: never the released segments and the new one at once.
    pool = sim()
    syncs = pool.device.counters()["syncs"]
    c = busy_release_then_grow(pool, S1)
    assert device(pool, "allocs", "frees") == {"allocs": 4, "frees": 2}
    assert pool.device.counters()["syncs"] == syncs + 1       # the release's stream, once
    info = pool.device.stream_info(S1)
    assert info["completed"] == info["submitted"]
    assert pool.stats()["reserved_bytes.all.peak"] == 42 * MiB
    assert pool.device.held_peak_bytes == 42 * MiB              # not 16 + 20 + the 26 freed
    assert pool.device.held_bytes == pool.reserved_bytes() == 36 * MiB
    pool.free(c, stream=S1)


def test_a_growth_that_releases_on_an_idle_stream_asks_and_does_not_sync(sim):
    # Note [Released before a growth]: an idle stream's frees have run, and the driver reuses
    # their memory at once; a sync would only make it give that memory back and map more.
    pool = sim()
    for p in [pool.alloc(n * MiB, stream=S1) for n in (12, 14, 16)]:
        pool.free(p, stream=S1)
    before = pool.device.counters()
    queries = pool.stats()["num_stream_queries"]
    c = pool.alloc(20 * MiB, stream=S1)
    after = pool.device.counters()
    assert after["frees"] - before["frees"] == 2
    assert after["syncs"] == before["syncs"]
    assert after["stream_queries"] - before["stream_queries"] == 1
    assert pool.stats()["num_stream_queries"] == queries + 1
    assert pool.device.held_peak_bytes == 42 * MiB
    pool.free(c, stream=S1)


def test_a_release_on_another_stream_syncs_that_stream_not_the_growing_one(sim):
    pool = sim()
    for p in [pool.alloc(n * MiB, stream=S2) for n in (12, 14, 16)]:
        pool.free(p, stream=S2)
    pool.device.launch(S2)
    pool.device.launch(S1)                            # the growing stream is busy too
    c = pool.alloc(20 * MiB, stream=S1)
    assert device(pool, "frees") == {"frees": 2}
    assert pool.device.stream_info(S2)["completed"] == pool.device.stream_info(S2)["submitted"]
    assert pool.device.stream_info(S1)["completed"] < pool.device.stream_info(S1)["submitted"]
    assert pool.device.held_peak_bytes == 42 * MiB
    pool.free(c, stream=S1)


def test_a_growth_that_releases_nothing_synchronizes_nothing(sim):
    pool = sim()
    pool.device.launch(S1)
    syncs = pool.device.counters()["syncs"]
    ptrs = [pool.alloc(n * MiB, stream=S1) for n in (12, 40, 64)]   # each one a new segment
    assert device(pool, "allocs", "frees") == {"allocs": 3, "frees": 0}
    assert pool.device.counters()["syncs"] == syncs
    assert pool.device.stream_info(S1)["completed"] < pool.device.stream_info(S1)["submitted"]
    for p in ptrs:
        pool.free(p, stream=S1)


def test_the_sim_keeps_a_segment_freed_behind_queued_work_until_that_work_runs(sim):
    # Note [Frees the driver keeps] on its own: empty_cache's frees are stream-ordered and
    # need no sync; the device holds their bytes until the stream's work completes.
    pool = sim()
    pool.free(pool.alloc(12 * MiB, stream=S1), stream=S1)
    pool.device.launch(S1)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and pool.device.used_bytes == 0
    assert pool.device.held_bytes == 12 * MiB
    pool.device.complete(S1)
    assert pool.device.held_bytes == 0


def test_a_growth_that_fits_only_once_the_released_segments_are_back_succeeds(sim):
    # The device's kept bytes count against its capacity (Note [Frees the driver keeps]): 42
    # MiB released behind queued work and a 40 MiB segment do not fit in 64 MiB together. The
    # sync before the allocation gives the 42 MiB back first, so the request is served.
    pool = sim(capacity="64MiB")
    for p in [pool.alloc(n * MiB, stream=S1) for n in (12, 14, 16)]:
        pool.free(p, stream=S1)
    pool.device.launch(S1)
    c = pool.alloc(40 * MiB, stream=S1)            # all three idle segments go for it
    assert device(pool, "frees") == {"frees": 3}
    assert counters(pool, "num_alloc_retries", "num_ooms") == \
        {"num_alloc_retries": 0, "num_ooms": 0}
    assert pool.device.held_peak_bytes == 42 * MiB
    pool.free(c, stream=S1)


@pytest.mark.parametrize("other", [S1, S2])
def test_a_release_behind_queued_work_does_not_fail_a_later_growth(sim, other):
    # Note [The last try waits for the device]: release_threshold 0 frees the idle segment
    # behind S1's queued work (stream-ordered, nobody waits), so the device keeps its 40 MiB
    # and refuses the next segment. The retry's last try waits for the device and fits.
    pool = sim(capacity="64MiB", release_threshold=0)
    a = pool.alloc(40 * MiB, stream=S1)
    pool.device.launch(S1)
    pool.free(a, stream=S1)
    assert pool.reserved_bytes() == 0 and pool.device.held_bytes == 40 * MiB
    b = pool.alloc(50 * MiB, stream=other)
    st = pool.stats()
    assert (st["num_ooms"], st["num_sync_all_streams"]) == (0, 1)
    assert pool.device.counters()["failed"] >= 1
    pool.free(b, stream=other)


def test_the_sim_refuses_what_fits_only_in_bytes_it_keeps(sim):
    pool = sim(capacity="64MiB")
    pool.free(pool.alloc(40 * MiB, stream=S1), stream=S1)
    pool.device.launch(S1)
    pool.empty_cache()                              # stream-ordered: kept until S1's work runs
    assert pool.device.held_bytes == 40 * MiB
    # 40 kept + 30 > 64: the device refuses the segment, and with nothing left to release
    # the last try of the retry waits for the device (Note [The last try waits for the
    # device]), whose kept bytes then come back: the request is served.
    syncs = pool.stats()["num_sync_all_streams"]
    pool.free(pool.alloc(30 * MiB, stream=S2), stream=S2)
    assert pool.device.counters()["failed"] >= 1
    assert pool.device.held_bytes == pool.reserved_bytes() == 30 * MiB   # nothing kept now
    assert pool.stats()["num_sync_all_streams"] == syncs + 1
    assert pool.stats()["num_ooms"] == 0
