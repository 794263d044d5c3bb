"""min_map_size: a growth at the end of an expandable range maps at least that much, as one
physical allocation (Note [Edge growth] in mempool/_csrc/core/mp_expand.c), on the simulated
device, where every map call is counted.

The driver's time follows its physical allocations, so fewer, larger ones at the edge cost
less; holes between mapped pages are still filled to the page, and a pool with a limit
ignores the option (there every free page must be able to go)."""
import pytest

import mempool

from _support import BASE, GiB, MiB

FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3


def maps(pool, index=0):
    """The physical allocations of one range: [(offset in the range, size)]."""
    seg = pool.layout()[index]
    return [(a - seg["address"], n) for a, n in seg["maps"]]


def map_calls(pool):
    return pool.device.counters()["maps"]


def test_a_growth_at_the_edge_maps_at_least_min_map_size_in_one_allocation(sim):
    pool = sim(expandable_segments=True, capacity=GiB, min_map_size=16 * MiB)
    a = pool.alloc(3 * MiB)                     # two pages needed: eight mapped, one call
    assert maps(pool) == [(0, 16 * MiB)] and map_calls(pool) == 1
    rest = [pool.alloc(3 * MiB) for _ in range(4)]   # 15 MiB in all: inside the 16 MiB
    assert map_calls(pool) == 1 and pool.reserved_bytes() == 16 * MiB
    b = pool.alloc(3 * MiB)                     # 1 MiB free at the edge: 2 MiB more needed
    assert maps(pool) == [(0, 16 * MiB), (16 * MiB, 16 * MiB)] and map_calls(pool) == 2
    assert b == BASE + 15 * MiB                 # it joined the edge's free block
    big = pool.alloc(40 * MiB)                  # more than the minimum: what it needs
    assert maps(pool)[-1] == (32 * MiB, 40 * MiB - 14 * MiB)
    for p in (a, *rest, b, big):
        pool.free(p)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0
    pool.check_invariants()


def test_without_it_a_growth_maps_what_its_request_needs(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(3 * MiB)
    assert maps(pool) == [(0, 4 * MiB)]
    pool.free(a)
    assert mempool.Pool(backend="sim").options["min_map_size"] is None


def test_a_hole_is_filled_to_the_page_not_to_min_map_size(sim):
    """Only the end of a range is rounded: a hole a release left is refilled with just the
    pages a request needs, so holes cost no more memory than without the option."""
    pool = sim(expandable_segments=True, capacity=GiB, min_map_size=16 * MiB)
    a = pool.alloc(16 * MiB)                    # [0, 16): one allocation
    b = pool.alloc(16 * MiB)                    # [16, 32): another
    c = pool.alloc(16 * MiB)                    # [32, 48): a third, at the edge
    pool.free(b)
    pool.empty_cache()                          # b's allocation goes: a hole of 16 MiB
    assert maps(pool) == [(0, 16 * MiB), (32 * MiB, 16 * MiB)]
    calls = map_calls(pool)
    d = pool.alloc(3 * MiB)                     # into the hole: two pages, not sixteen MiB
    assert d == BASE + 16 * MiB and map_calls(pool) == calls + 1
    assert (16 * MiB, 4 * MiB) in maps(pool)
    assert pool.reserved_bytes() == 36 * MiB
    for p in (a, c, d):
        pool.free(p)
    pool.check_invariants()


def test_a_pool_with_a_limit_maps_only_what_its_requests_need(sim):
    """Under a limit every free page must be able to go: the edge is not rounded there, so a
    request that fits the limit is never refused for the rounding."""
    pool = sim(expandable_segments=True, capacity=GiB, min_map_size=64 * MiB,
               limit=10 * MiB)
    a = pool.alloc(3 * MiB)
    b = pool.alloc(5 * MiB)                     # 8 MiB in all: under the 10 MiB limit
    assert pool.reserved_bytes() == 8 * MiB
    for p in (a, b):
        pool.free(p)


def test_a_request_the_device_holds_is_never_refused_for_the_rounding(sim):
    """The device may hold the request and not the rounded growth (another range took its
    memory): the exact growth follows at once, before any release or wait."""
    pool = sim(expandable_segments=True, capacity=100 * MiB, min_map_size=64 * MiB)
    a = pool.alloc(50 * MiB)                    # the large range maps 64 MiB
    assert pool.reserved_bytes() == 64 * MiB
    retries = pool.stats()["num_alloc_retries"]
    b = pool.alloc(4096)                        # the small range: 64 MiB do not fit, 2 do
    assert pool.reserved_bytes() == 66 * MiB
    assert pool.stats()["num_alloc_retries"] == retries and pool.stats()["num_device_free"] == 0
    c = pool.alloc(30 * MiB)                    # 14 MiB free at the large edge, 16 more fit
    assert pool.reserved_bytes() == 82 * MiB
    for p in (a, b, c):
        pool.free(p)
    pool.check_invariants()


def test_the_rounding_never_passes_the_collection_threshold_nor_releases(sim):
    """The rounding is opportunistic: where it would take the pool past
    garbage_collection_threshold the growth maps what the request needs, and it makes no
    release of its own (before, 64 MiB idle on another stream were unmapped to make room
    for the rounded growth)."""
    pool = sim(expandable_segments=True, capacity=GiB, min_map_size=64 * MiB,
               garbage_collection_threshold=0.5, cross_stream_reuse=False)   # 512 MiB
    a = pool.alloc(500 * MiB)
    pool.free(a)
    pool.empty_cache()                          # the high-water mark stays at 500 MiB
    b = pool.alloc(64 * MiB, stream=7)
    pool.free(b, stream=7)                      # 64 MiB idle on stream 7
    c = pool.alloc(430 * MiB)                   # 494 MiB mapped
    unmaps = pool.stats()["num_device_free"]
    d = pool.alloc(4 * MiB)                     # needs 4 (498 in all); 64 would pass 512
    assert pool.reserved_bytes() == 498 * MiB
    assert pool.stats()["num_device_free"] == unmaps
    for p in (c, d):
        pool.free(p)
    pool.check_invariants()


def test_a_minimum_past_the_range_maps_the_whole_tail_and_never_wraps(sim):
    """A minimum as large as the range, or past any size (2**64 - 2 bytes rounded up to a
    page would wrap to a few pages), maps the whole unmapped tail when the device holds it."""
    for least in (GiB, 1 << 62, (1 << 64) - 2):
        pool = sim(expandable_segments=True, capacity=GiB, min_map_size=least)
        a = pool.alloc(3 * MiB)
        assert pool.reserved_bytes() == GiB == pool.layout()[0]["total_size"], least
        pool.free(a)
        pool.check_invariants()


def test_a_growing_loop_makes_fewer_allocations_for_a_little_more_at_the_peak(sim):
    """What the option trades: a warm-up of many small growths at the edge (the shipped
    traces' pattern) in fewer map calls, the peak at most min_map_size a range higher."""
    def warm_up(**options):
        pool = sim(expandable_segments=True, capacity=GiB, granularity=2 * MiB, **options)
        live = [pool.alloc((1 + i % 5) * MiB + 4096) for i in range(60)]
        peak = pool.reserved_bytes()
        calls = map_calls(pool)
        for p in live:
            pool.free(p)
        pool.check_invariants()
        return calls, peak

    plain_calls, plain_peak = warm_up()
    calls, peak = warm_up(min_map_size=32 * MiB)
    assert calls * 4 <= plain_calls
    assert plain_peak <= peak <= plain_peak + 32 * MiB


def test_min_map_size_is_checked_and_read_from_conf_strings():
    for bad in (-1, "lots", 1.5):
        with pytest.raises(ValueError, match="min_map_size"):
            mempool.Pool(backend="sim", expandable_segments=True, min_map_size=bad)
    pool = mempool.Pool.from_conf("backend:sim,expandable_segments:True,min_map_size_mb:64")
    assert pool.options["min_map_size"] == 64 * MiB
    for none in (None, "none", 0):
        assert mempool.Pool(backend="sim", expandable_segments=True,
                            min_map_size=none).options["min_map_size"] is None
