"""Split and merge on the simulated device, with exact addresses.

Policy: best fit by size, ties to the most recently freed block; small requests (<= 1 MiB)
come from 2 MiB segments, requests below 10 MiB from 20 MiB segments, larger ones from a
segment of their own size rounded to 2 MiB.
"""
from _support import BASE, MiB, blocks

FREE, ALLOC, PENDING = 0, 1, 2


def test_first_allocation_splits_a_small_segment(sim):
    pool = sim()
    a = pool.alloc(1000)
    assert a == BASE
    assert blocks(pool) == [(0, 1024, ALLOC), (1024, 2 * MiB - 1024, FREE)]
    assert pool.reserved_bytes() == 2 * MiB
    assert pool.used_bytes() == 1024
    assert pool.cached_bytes() == 2 * MiB - 1024


def test_blocks_are_carved_in_address_order(sim):
    pool = sim()
    ptrs = [pool.alloc(n) for n in (512, 1536, 4096, 100)]
    assert [p - BASE for p in ptrs] == [0, 512, 2048, 6144]


def test_free_merges_with_both_neighbours(sim):
    pool = sim()
    a, b, c = pool.alloc(512), pool.alloc(512), pool.alloc(512)
    pool.free(a)
    pool.free(c)
    # c merged with the segment's free tail; a stands alone
    assert blocks(pool) == [(0, 512, FREE), (512, 512, ALLOC), (1024, 2 * MiB - 1024, FREE)]
    pool.free(b)
    assert blocks(pool) == [(0, 2 * MiB, FREE)]
    assert pool.stats()["inactive_split.all.current"] == 0


def test_best_fit_prefers_the_smallest_block_that_fits(sim):
    pool = sim()
    ptrs = [pool.alloc(n) for n in (4096, 512, 2048, 512, 8192, 512)]
    pool.free(ptrs[0])   # 4096 hole at 0
    pool.free(ptrs[2])   # 2048 hole at 4608
    pool.free(ptrs[4])   # 8192 hole
    assert pool.alloc(2000) == ptrs[2]
    assert pool.alloc(3000) == ptrs[0]
    assert pool.alloc(5000) == ptrs[4]


def test_equal_sizes_reuse_the_most_recently_freed(sim):
    pool = sim()
    ptrs = [pool.alloc(1024) for _ in range(6)]
    pool.free(ptrs[1])
    pool.free(ptrs[3])
    assert pool.alloc(1024) == ptrs[3]
    assert pool.alloc(1024) == ptrs[1]


def test_large_requests_use_20mib_segments_and_split_above_1mib(sim):
    pool = sim()
    small = pool.alloc(512)
    a = pool.alloc(3 * MiB)
    assert a == BASE + 2 * MiB                       # a second segment, after the small one
    assert pool.reserved_bytes() == 22 * MiB
    b = pool.alloc(5 * MiB)
    assert b == a + 3 * MiB                          # split from the same 20 MiB segment
    c = pool.alloc(11 * MiB)                          # fits the 12 MiB left
    assert c == b + 5 * MiB
    # 1 MiB left: not split off for a large request (remaining must exceed 1 MiB)
    d = pool.alloc(int(1.5 * MiB))
    assert d == BASE + 22 * MiB
    for p in (small, a, b, c, d):
        pool.free(p)


def test_large_remainder_of_one_mib_or_less_is_not_split(sim):
    pool = sim()
    a = pool.alloc(19 * MiB)                          # its own 20 MiB segment
    assert pool.block_info(a)[:2] == (20 * MiB, 19 * MiB)   # the 1 MiB remainder stays in it
    pool.free(a)


def test_big_requests_get_their_own_segment(sim):
    pool = sim()
    a = pool.alloc(33 * MiB + 1)
    assert pool.reserved_bytes() == 34 * MiB
    assert blocks(pool) == [(0, 34 * MiB, ALLOC)]    # remainder under 1 MiB: not split
    pool.free(a)


def test_small_and_large_lists_are_separate(sim):
    pool = sim()
    big = pool.alloc(12 * MiB)
    pool.free(big)                                     # a free 12 MiB segment
    small = pool.alloc(4096)
    assert small != big                                # small requests never shred it
    assert pool.reserved_bytes() == 14 * MiB
    pool.free(small)


def test_max_split_size_keeps_oversize_blocks_whole(sim):
    pool = sim(max_split_size=64 * MiB)
    a = pool.alloc(100 * MiB)
    pool.free(a)
    c = pool.alloc(90 * MiB)                          # oversize request: a block < 90+20 MiB
    assert c == a
    assert pool.block_info(c)[0] == 100 * MiB          # never split
    stats = pool.stats()
    assert stats["oversize_allocations.current"] == 1
    assert stats["oversize_segments.current"] == 1
    assert stats["max_split_size"] == 64 * MiB
    pool.free(c)
    b = pool.alloc(30 * MiB)                          # may not take (and split) the 100 MiB block:
    assert b != a                                     # a new segment, and the idle oversize one,
    assert pool.reserved_bytes() == 30 * MiB          # unusable for it, goes back
    pool.free(b)


def test_zero_bytes_is_a_distinct_valid_pointer(sim):
    pool = sim()
    a, b = pool.alloc(0), pool.alloc(0)
    assert a != b
    assert pool.block_info(a)[:2] == (512, 0)
    pool.free(a)
    pool.free(b)


def test_stats_follow_pytorch_families(sim):
    pool = sim()
    a = pool.alloc(1000)
    b = pool.alloc(3 * MiB)
    s = pool.stats()
    assert s["allocation.all.current"] == 2
    assert s["allocation.small_pool.current"] == 1
    assert s["allocation.large_pool.current"] == 1
    assert s["allocated_bytes.all.current"] == 1024 + 3 * MiB
    assert s["requested_bytes.all.current"] == 1000 + 3 * MiB
    assert s["reserved_bytes.all.current"] == 22 * MiB
    assert s["segment.all.current"] == 2
    assert s["inactive_split.all.current"] == 2
    assert s["inactive_split_bytes.all.current"] == 22 * MiB - 1024 - 3 * MiB
    assert s["num_device_alloc"] == 2
    pool.free(a)
    pool.free(b)
    s = pool.stats()
    assert s["allocation.all.current"] == 0
    assert s["allocation.all.allocated"] == 2 and s["allocation.all.freed"] == 2
    assert s["allocated_bytes.all.peak"] == 1024 + 3 * MiB
    pool.reset_peak_stats()
    assert pool.stats()["allocated_bytes.all.peak"] == 0
