"""Expandable segments on real host memory: the bytes are real, so they are written and read back.

The host upstream reserves address space with PROT_NONE and maps pages by making them
read-write (unmapping drops them and protects them again), so a block placed in a page that
is not mapped would fault, and bytes lost across a page boundary, a growth or an unmap and
remap would show as a wrong pattern.
"""
import ctypes
import random

import pytest

from _support import releasable_maps, run_threads

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3


def fill(ptr, n, seed):
    """A pattern that differs per block and per position, so misplaced bytes show."""
    rnd = random.Random(seed)
    data = bytes(rnd.randrange(256) for _ in range(min(n, 4096)))
    data = (data * (n // len(data) + 1))[:n]
    ctypes.memmove(ptr, data, n)
    return data


def check(ptr, data):
    assert ctypes.string_at(ptr, len(data)) == data, f"block {ptr:#x} lost its bytes"


@pytest.fixture
def pool(host):
    return host(expandable_segments=True, capacity=256 * MiB, granularity=PAGE)


def test_blocks_of_a_grown_range_hold_their_bytes_across_page_boundaries(pool):
    sizes = [100_000, 3 * PAGE + 512, 70_000, 5 * PAGE, 1 * MiB + 1, 130_000, 2 * MiB + 4097]
    live = []
    for i, n in enumerate(sizes * 4):
        ptr = pool.alloc(n)
        live.append((ptr, fill(ptr, n, i)))
    large = sorted(p for p, d in live if len(d) > MiB)
    assert len(large) == 8
    # the large blocks sit back to back in one range, so they straddle page boundaries
    assert all(b - a == pool.block_info(a)[0] for a, b in zip(large, large[1:]))
    assert all(pool.layout()[i]["is_expandable"] for i in range(len(pool.layout())))
    assert pool.reserved_bytes() == pool.device.used_bytes
    assert pool.reserved_bytes() % PAGE == 0
    for ptr, data in live:
        check(ptr, data)
    for ptr, _ in live:
        pool.free(ptr)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and pool.device.used_bytes == 0


def test_bytes_survive_unmapping_a_neighbour_and_mapping_it_again(pool):
    a = pool.alloc(3 * PAGE + 100)                       # maps [0, 4 pages): one allocation
    b = pool.alloc(8 * PAGE - 512)                       # a's free tail + [4, 11): another
    c = pool.alloc(2 * PAGE)                             # [11, 13), beginning on a page edge
    da, db, dc = fill(a, 3 * PAGE + 100, 1), fill(b, 8 * PAGE - 512, 2), fill(c, 2 * PAGE, 3)
    check(b, db)
    pool.free(b)
    pool.empty_cache()                                   # b's own allocation is unmapped whole
    lay = pool.layout()[0]["blocks"]
    assert [x["state"] for x in lay[:4]] == [ALLOCATED, FREE, UNMAPPED, ALLOCATED]
    assert lay[2]["size"] == 7 * PAGE
    check(a, da)
    check(c, dc)
    d = pool.alloc(7 * PAGE)                             # maps the hole again
    assert a < d < c
    hole = [x for x in lay if x["state"] == UNMAPPED][0]
    # fresh pages: the old bytes are gone (unmapped pages come back zeroed)
    assert ctypes.string_at(hole["address"], hole["size"]) == bytes(hole["size"])
    dd = fill(d, 7 * PAGE, 4)
    for ptr, data in ((a, da), (c, dc), (d, dd)):
        check(ptr, data)
    for ptr in (a, c, d):
        pool.free(ptr)


def test_a_map_that_fails_part_way_leaves_the_mapped_bytes_intact(pool):
    a = pool.alloc(5 * PAGE)
    da = fill(a, 5 * PAGE, 5)
    pool.device.fail_map_after(3)
    b = pool.alloc(8 * PAGE)                             # fails after 3 pages, undone, retried
    assert pool.device.counters()["failed"] == 1
    assert pool.reserved_bytes() == pool.device.used_bytes == 13 * PAGE
    db = fill(b, 8 * PAGE, 6)
    check(a, da)
    check(b, db)
    pool.free(a)
    pool.free(b)


def test_release_threshold_unmaps_and_maps_while_bytes_stay_right(host):
    pool = host(expandable_segments=True, capacity=256 * MiB, granularity=PAGE,
                release_threshold=0)
    rnd = random.Random(7)
    live = []
    for i in range(400):
        if live and rnd.random() < 0.45:
            ptr, data = live.pop(rnd.randrange(len(live)))
            check(ptr, data)
            pool.free(ptr)
        else:
            n = rnd.choice((rnd.randrange(1, 4 * KiB), rnd.randrange(1, 16 * PAGE)))
            ptr = pool.alloc(n)
            live.append((ptr, fill(ptr, n, i)))
        assert releasable_maps(pool) == 0                # only allocations in use stay cached
    for ptr, data in live:
        check(ptr, data)
        pool.free(ptr)
    assert pool.reserved_bytes() == 0
    # deterministic (seeded): a free allocation wholly inside a free run goes at once
    assert pool.device.counters()["unmaps"] == 42


def worker(pool, seed, rounds, errors):
    rnd = random.Random(seed)
    live = []
    try:
        for i in range(rounds):
            if live and rnd.random() < 0.48:
                ptr, data, stream = live.pop(rnd.randrange(len(live)))
                if ctypes.string_at(ptr, len(data)) != data:
                    errors.append(f"block {ptr:#x} ({len(data)} bytes) was overwritten")
                pool.free(ptr, stream=stream if rnd.random() < 0.5 else None)
            else:
                n = int(2 ** rnd.uniform(8, 21))
                stream = rnd.choice((0, 1, 2))
                ptr = pool.alloc(n, stream=stream)
                live.append((ptr, fill(ptr, n, seed * 100_000 + i), stream))
            if rnd.random() < 0.02:
                pool.trim(rnd.randrange(0, 8 * MiB))
        for ptr, data, _ in live:
            if ctypes.string_at(ptr, len(data)) != data:
                errors.append(f"block {ptr:#x} ({len(data)} bytes) was overwritten")
            pool.free(ptr)
    except Exception as exc:   # surfaced by the test thread below
        errors.append(repr(exc))


@pytest.mark.parametrize("options", [{}, {"release_threshold": 4 * MiB},
                                     {"limit": 128 * MiB, "garbage_collection_threshold": 0.25}],
                         ids=str)
def test_threads_grow_release_and_verify(host, options):
    pool = host(expandable_segments=True, capacity=512 * MiB, granularity=PAGE, **options)
    errors = []
    run_threads(worker, [(pool, seed, 600, errors) for seed in range(4)])
    assert errors == []
    pool.check_invariants()
    assert pool.used_bytes() == 0
    if options:
        assert pool.device.counters()["unmaps"] > 0      # releases ran among the threads
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 == pool.device.used_bytes
