"""Expandable segments on the simulated device: growth page by page, exact addresses.

One address range per (stream, small/large), as large as the device, mapped in pages of the
upstream's granularity (2 MiB unless the pool says otherwise) as blocks need them. New blocks
grow at the mapped edge (or into an unmapped hole, whichever maps fewer bytes), freed blocks
merge back, and reserved_bytes counts exactly the mapped pages: the pool's figure, the
device's own count and the layout always agree.
"""
import pytest

import mempool
from mempool.tools import report

from _support import BASE, GiB, MiB

FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3
# One physical allocation per page (max_map_size = the page), so that a release may take any
# whole page: the tests that pin where pages go inside a free run use it. By default a growth
# is one allocation, released only whole (Note [Growth extents]; tests/core/test_expandable_maps.py).
PAGEWISE = dict(max_map_size=2 * MiB)
S = 7


def layout(pool):
    """[(range offset from BASE, [(offset in range, size, state), ...]), ...]"""
    return [(seg["address"] - BASE,
             [(b["address"] - seg["address"], b["size"], b["state"]) for b in seg["blocks"]])
            for seg in pool.layout()]


def mapped(pool):
    """Reserved bytes by the pool's count, the layout, the stats and the device: all equal."""
    lay = pool.layout()
    by_blocks = sum(b["size"] for s in lay for b in s["blocks"] if b["state"] != UNMAPPED)
    st = pool.stats()
    assert by_blocks == sum(s["mapped_size"] for s in lay)
    assert by_blocks == pool.reserved_bytes() == st["reserved_bytes.all.current"]
    assert by_blocks == st["mapped_bytes.current"] == pool.device.counters()["mapped_bytes"]
    assert by_blocks == pool.device.used_bytes
    return by_blocks


def test_growth_maps_just_the_pages_a_block_needs_at_the_edge(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(3 * MiB)
    assert a == BASE
    assert mapped(pool) == 4 * MiB                      # two 2 MiB pages
    assert layout(pool) == [(0, [(0, 3 * MiB, ALLOCATED), (3 * MiB, MiB, FREE),
                                 (4 * MiB, GiB - 4 * MiB, UNMAPPED)])]
    b = pool.alloc(3 * MiB)                             # 1 MiB free at the edge + one page
    assert b == BASE + 3 * MiB
    assert mapped(pool) == 6 * MiB
    c = pool.alloc(MiB + 4096)                          # the edge has nothing free: one page
    assert c == BASE + 6 * MiB
    assert mapped(pool) == 8 * MiB
    assert pool.device.counters()["maps"] == 3
    assert pool.stats()["num_device_alloc"] == 3
    assert layout(pool) == [(0, [(0, 3 * MiB, ALLOCATED), (3 * MiB, 3 * MiB, ALLOCATED),
                                 (6 * MiB, MiB + 4096, ALLOCATED),
                                 (7 * MiB + 4096, MiB - 4096, FREE),
                                 (8 * MiB, GiB - 8 * MiB, UNMAPPED)])]
    for p in (a, b, c):
        pool.free(p)


def test_freed_blocks_merge_back_into_one_that_serves_a_larger_request(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    ptrs = [pool.alloc(3 * MiB) for _ in range(4)]        # [0, 12) MiB, all mapped
    for p in ptrs:
        pool.free(p)
    assert layout(pool)[0][1][:1] == [(0, 12 * MiB, FREE)]
    big = pool.alloc(12 * MiB)                            # no new page
    assert big == BASE and pool.device.counters()["maps"] == 4
    pool.free(big)
    bigger = pool.alloc(13 * MiB)                         # the free edge block + one page
    assert bigger == BASE and mapped(pool) == 14 * MiB
    assert pool.device.counters()["maps"] == 5
    pool.free(bigger)


def test_the_free_block_at_the_edge_is_extended_not_abandoned(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(5 * MiB)                               # [0, 5) + 1 MiB free at the edge
    b = pool.alloc(8 * MiB)                               # uses it: [5, 13), maps 7 MiB -> 8
    assert b == BASE + 5 * MiB and mapped(pool) == 14 * MiB
    pool.free(a)
    pool.free(b)


def test_ranges_are_reserved_per_stream_and_size_kind(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    large = pool.alloc(2 * MiB)
    small = pool.alloc(512)
    other = pool.alloc(2 * MiB, stream=S)
    assert large == BASE                                  # stream 0, large: first range
    assert small == BASE + GiB                            # stream 0, small
    assert other == BASE + 2 * GiB                        # stream S, large
    lay = pool.layout()
    assert [(s["address"] - BASE, s["stream"], s["is_small"], s["is_expandable"], s["total_size"])
            for s in lay] == [(0, 0, False, True, GiB), (GiB, 0, True, True, GiB),
                              (2 * GiB, S, False, True, GiB)]
    st = pool.stats()
    assert st["va_reserved_bytes.current"] == 3 * GiB
    assert (st["segment.small_pool.current"], st["segment.large_pool.current"]) == (1, 2)
    assert (st["reserved_bytes.small_pool.current"], st["reserved_bytes.large_pool.current"]) == \
        (2 * MiB, 4 * MiB)
    assert mapped(pool) == 6 * MiB
    for p in (large, small, other):
        pool.free(p)


def test_address_space_follows_the_device_capacity(sim):
    pool = sim(expandable_segments=True, capacity=3 * GiB + 3 * MiB)
    pool.free(pool.alloc(MiB + 1))
    assert pool.layout()[0]["total_size"] == 3 * GiB + 4 * MiB   # rounded up to pages
    assert pool.stats()["va_reserved_bytes.peak"] == 3 * GiB + 4 * MiB


@pytest.mark.parametrize("granularity, page", [("64KiB", 64 << 10), (512, 512), (4 * MiB, 4 * MiB)])
def test_granularity_sets_the_page(sim, granularity, page):
    pool = sim(expandable_segments=True, capacity=GiB, granularity=granularity)
    assert pool.options["granularity"] == page
    a = pool.alloc(3 * MiB + 1)
    want = -(-(3 * MiB + 512) // page) * page
    assert mapped(pool) == want
    assert pool.layout()[0]["total_size"] % page == 0
    pool.free(a)
    pool.empty_cache()
    assert mapped(pool) == 0


def test_granularity_is_refused_when_not_a_multiple_of_512():
    # (on cuda: tests/upstreams/test_cuda_fake_driver.py and tests/gpu/test_gpu_expandable.py)
    with pytest.raises(ValueError, match="'granularity' .* positive multiple of 512"):
        mempool.Pool(backend="sim", expandable_segments=True, granularity=1000)


def test_granularity_is_a_conf_key():
    pool = mempool.Pool.from_conf("backend:sim,expandable_segments:true,granularity:64KiB",
                                  capacity=GiB)
    assert pool.options["granularity"] == 64 << 10
    p = pool.alloc(MiB + 1)
    assert pool.reserved_bytes() == MiB + 64 * 1024
    pool.free(p)


def test_conf_string_turns_expandable_segments_on():
    pool = mempool.Pool.from_conf("backend:sim,expandable_segments:true", capacity=GiB)
    assert pool.options["expandable_segments"] is True
    p = pool.alloc(MiB + 1)
    assert pool.layout()[0]["is_expandable"] and pool.layout()[0]["total_size"] == GiB
    pool.free(p)
    pool.check_invariants()


def test_expandable_segments_win_over_max_split_size_as_in_pytorch(monkeypatch):
    monkeypatch.setattr(mempool._conf_parse, "_warned", set())
    with pytest.warns(mempool.ConfigWarning, match="'expandable_segments' and 'max_split_size'"):
        pool = mempool.Pool(backend="sim", expandable_segments=True, max_split_size="64MB")
    assert pool.options["expandable_segments"] is True and pool.options["max_split_size"] is None
    pool = mempool.Pool.from_conf("backend:sim,expandable_segments:True,max_split_size_mb:64")
    assert pool.options["max_split_size"] is None            # warned once, above
    p = pool.alloc(64 * MiB)
    assert pool.layout()[0]["is_expandable"]
    pool.free(p)
    pool.check_invariants()


def test_growth_refills_a_hole_when_that_maps_fewer_bytes_than_the_edge(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a, b, c = (pool.alloc(4 * MiB) for _ in range(3))     # [0,4) [4,8) [8,12)
    pool.free(b)
    pool.trim(0)                                          # b's pages go: a 4 MiB hole
    assert layout(pool)[0][1] == [(0, 4 * MiB, ALLOCATED), (4 * MiB, 4 * MiB, UNMAPPED),
                                  (8 * MiB, 4 * MiB, ALLOCATED),
                                  (12 * MiB, GiB - 12 * MiB, UNMAPPED)]
    d = pool.alloc(3 * MiB)                               # hole and edge both map 4 MiB: lower
    assert d == BASE + 4 * MiB
    assert mapped(pool) == 12 * MiB
    e = pool.alloc(5 * MiB)                               # the MiB left in the hole cannot help
    assert e == BASE + 12 * MiB and mapped(pool) == 18 * MiB
    for p in (a, c, d, e):
        pool.free(p)


def test_growth_joins_free_blocks_on_both_sides_of_a_hole(sim):
    pool = sim(expandable_segments=True, **PAGEWISE, capacity=GiB)
    a = pool.alloc(3 * MiB)                               # [0, 3)
    b = pool.alloc(4 * MiB)                               # [3, 7)
    c = pool.alloc(3 * MiB)                               # [7, 10)
    keep = pool.alloc(2 * MiB)                            # [10, 12)
    pool.free(b)
    pool.trim(0)                                          # pages [4, 6) go; 1 MiB free each side
    assert layout(pool)[0][1][:5] == [(0, 3 * MiB, ALLOCATED), (3 * MiB, MiB, FREE),
                                      (4 * MiB, 2 * MiB, UNMAPPED), (6 * MiB, MiB, FREE),
                                      (7 * MiB, 3 * MiB, ALLOCATED)]
    d = pool.alloc(4 * MiB)                               # maps the hole only: 2 MiB, not 4
    assert d == BASE + 3 * MiB
    assert mapped(pool) == 12 * MiB
    assert layout(pool)[0][1][1] == (3 * MiB, 4 * MiB, ALLOCATED)
    for p in (a, c, d, keep):
        pool.free(p)


def test_growth_joins_a_free_block_after_a_hole_by_mapping_its_end(sim):
    pool = sim(expandable_segments=True, **PAGEWISE, capacity=GiB)
    a = pool.alloc(4 * MiB)                               # [0, 4)
    b = pool.alloc(5 * MiB)                               # [4, 9)
    c = pool.alloc(3 * MiB)                               # [9, 12)
    pool.free(b)
    pool.trim(0)                                          # [4, 8) unmapped, [8, 9) free
    d = pool.alloc(3 * MiB)                               # [6, 9): maps [6, 8) beside the free MiB
    assert d == BASE + 6 * MiB
    assert layout(pool)[0][1][:4] == [(0, 4 * MiB, ALLOCATED), (4 * MiB, 2 * MiB, UNMAPPED),
                                      (6 * MiB, 3 * MiB, ALLOCATED), (9 * MiB, 3 * MiB, ALLOCATED)]
    assert mapped(pool) == 10 * MiB
    for p in (a, c, d):
        pool.free(p)


def test_a_used_up_range_hands_growth_to_a_new_one(sim):
    pool = sim(expandable_segments=True, capacity=8 * MiB)
    a, b, c, d = (pool.alloc(2 * MiB) for _ in range(4))  # the whole 8 MiB range
    pool.free(b)
    pool.free(d)
    pool.empty_cache()                                    # holes at [2, 4) and [6, 8)
    e = pool.alloc(4 * MiB)                               # 4 MiB free on the device, no room
    assert e == BASE + 8 * MiB                            # ... in the range: a second one
    st = pool.stats()
    assert st["va_reserved_bytes.current"] == 16 * MiB and st["segment.large_pool.current"] == 2
    assert mapped(pool) == 8 * MiB
    pool.free(e)
    pool.empty_cache()
    f = pool.alloc(4 * MiB)                               # growth stays in the new range
    assert f == e and mapped(pool) == 8 * MiB
    for p in (a, c, f):
        pool.free(p)


def test_a_request_beyond_the_device_fails_and_changes_nothing_mapped(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(3 * MiB)
    before = layout(pool)
    with pytest.raises(mempool.OutOfMemoryError, match="out of memory"):
        pool.alloc(2 * GiB)
    assert layout(pool) == before and mapped(pool) == 4 * MiB
    assert pool.stats()["num_ooms"] == 1
    b = pool.alloc(MiB + MiB // 2)                       # still usable, and grows as before
    assert b == BASE + 3 * MiB and mapped(pool) == 6 * MiB
    pool.free(a)
    pool.free(b)


def test_snapshot_shows_each_mapped_run_with_its_reservation(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a, b, c = (pool.alloc(4 * MiB) for _ in range(3))
    pool.free(b)
    pool.trim(0)
    snap = pool.snapshot()["segments"]
    assert [(s["address"] - BASE, s["total_size"], s["is_expandable"]) for s in snap] == \
        [(0, 4 * MiB, True), (8 * MiB, 4 * MiB, True)]
    assert all((s["va_address"], s["va_size"], s["mapped_size"]) == (BASE, GiB, 8 * MiB)
               for s in snap)
    assert sum(s["total_size"] for s in snap) == pool.reserved_bytes()
    # report.snapshot builds the same from the layout
    assert report.snapshot(pool.layout())["segments"] == snap
    for p in (a, c):
        pool.free(p)


def test_stats_count_maps_and_unmaps(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    p = pool.alloc(6 * MiB)
    pool.free(p)
    pool.empty_cache()
    st = pool.stats()
    assert (st["mapped_bytes.current"], st["mapped_bytes.peak"], st["mapped_bytes.allocated"],
            st["mapped_bytes.freed"]) == (0, 6 * MiB, 6 * MiB, 6 * MiB)
    assert (st["num_device_alloc"], st["num_device_free"]) == (1, 1)
    assert (st["va_reserved_bytes.current"], st["va_reserved_bytes.freed"]) == (GiB, 0)
    assert st["reserved_bytes.all.peak"] == 6 * MiB
    assert pool.device.counters()["maps"] == 1 and pool.device.counters()["unmaps"] == 1
