"""One physical allocation per growth, released only whole (Note [Growth extents] in
mempool/_csrc/core/mp_expand_range.c), on the simulated device, where every call is counted.

A driver's cost follows the number of physical allocations, and it maps and unmaps only
whole ones. So a growth of N pages is one map call (one allocation, or one per
max_map_size of it), the pool remembers each allocation (layout()'s ``maps``), and every
release path unmaps only allocations wholly inside free memory: the sim refuses an unmap
that cuts one (``counters()["split_unmaps"]``), as the driver does.
"""
import ctypes
import json
from ctypes import CFUNCTYPE, POINTER, byref, c_int, c_size_t, c_void_p

import pytest

import mempool
from mempool import _core

from _fake_cuda import upstream_fields
from _support import BASE, GiB, MiB, releasable_maps

FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3
S = 7


def maps(pool, index=0):
    """The physical allocations of one range: [(offset in the range, size)]."""
    seg = pool.layout()[index]
    return [(a - seg["address"], n) for a, n in seg["maps"]]


def states(pool, index=0):
    seg = pool.layout()[index]
    return [(b["address"] - seg["address"], b["size"], b["state"]) for b in seg["blocks"]]


def calls(pool):
    c = pool.device.counters()
    return c["maps"], c["unmaps"], c["live_maps"], c["split_unmaps"]


def test_a_growth_of_many_pages_is_one_physical_allocation(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(20 * MiB)                              # ten pages: one map call
    b = pool.alloc(3 * MiB)                               # two more: another
    c = pool.alloc(MiB + 4096)                            # 1 MiB free at the edge + one page
    assert (a, b, c) == (BASE, BASE + 20 * MiB, BASE + 23 * MiB)
    assert maps(pool) == [(0, 20 * MiB), (20 * MiB, 4 * MiB), (24 * MiB, 2 * MiB)]
    assert calls(pool) == (3, 0, 3, 0)
    assert pool.stats()["num_device_alloc"] == 3
    assert pool.reserved_bytes() == pool.device.counters()["mapped_bytes"] == 26 * MiB
    for p in (a, b, c):
        pool.free(p)


def test_max_map_size_cuts_a_large_growth_into_a_few_allocations(sim):
    pool = sim(expandable_segments=True, capacity=GiB, max_map_size=8 * MiB + 12345)
    a = pool.alloc(20 * MiB)                              # 8 + 8 + 4 (whole pages each)
    assert maps(pool) == [(0, 8 * MiB), (8 * MiB, 8 * MiB), (16 * MiB, 4 * MiB)]
    assert calls(pool) == (3, 0, 3, 0) and pool.stats()["num_device_alloc"] == 3
    pool.free(a)
    pool.empty_cache()                                    # one unmap over the three, whole
    assert maps(pool) == [] and calls(pool) == (3, 1, 0, 0)
    assert pool.reserved_bytes() == 0
    small = sim(expandable_segments=True, capacity=GiB, max_map_size=1)   # below a page: one
    p = small.alloc(6 * MiB)
    assert maps(small) == [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, 2 * MiB)]
    small.free(p)


def test_free_pages_of_an_allocation_in_use_stay_mapped(sim):
    """The mechanism's price: a release takes no page of an allocation that still holds a
    block. With one allocation per page (max_map_size = the page) the same pages go."""
    for options, kept in [({}, 20 * MiB), ({"max_map_size": 2 * MiB}, 4 * MiB)]:
        pool = sim(expandable_segments=True, capacity=GiB, **options)
        a = pool.alloc(20 * MiB)
        pool.free(a)
        b = pool.alloc(4 * MiB)                           # best fit: the first 4 MiB of a's
        assert b == BASE
        pool.empty_cache()
        assert pool.reserved_bytes() == kept, options
        assert pool.device.counters()["split_unmaps"] == 0
        assert releasable_maps(pool) == 0                 # nothing releasable was left
        pool.free(b)
        pool.empty_cache()                                # now the allocation goes, whole
        assert pool.reserved_bytes() == 0 and pool.device.counters()["split_unmaps"] == 0


def test_every_release_path_unmaps_whole_allocations_only(sim):
    """trim, empty_cache, release_threshold, limit, garbage collection, an out-of-memory
    retry and forget_stream, each with an allocation some of whose pages hold a block: the
    sim never sees an unmap that cuts one, and what is wholly free goes."""
    def fill(pool, stream=0):
        # allocations [0, 20) free, [20, 22) in use, [22, 32) with a block at its start,
        # [32, 34) in use
        a, c, b, e = (pool.alloc(n * MiB, stream) for n in (20, 2, 10, 2))
        pool.free(a, stream)
        pool.free(b, stream)
        keep = pool.alloc(2 * MiB, stream)                # best fit: in b's allocation
        assert keep == BASE + 22 * MiB
        return [keep, c, e]

    kept = [(20 * MiB, 2 * MiB), (22 * MiB, 10 * MiB), (32 * MiB, 2 * MiB)]
    pool = sim(expandable_segments=True, capacity=GiB)
    fill(pool)
    pool.trim(0)
    assert maps(pool) == kept and pool.reserved_bytes() == 14 * MiB
    assert states(pool)[:4] == [(0, 20 * MiB, UNMAPPED), (20 * MiB, 2 * MiB, ALLOCATED),
                                (22 * MiB, 2 * MiB, ALLOCATED), (24 * MiB, 8 * MiB, FREE)]
    pool.empty_cache()
    assert maps(pool) == kept

    pool = sim(expandable_segments=True, capacity=GiB, release_threshold=0)
    a, c, b = (pool.alloc(n) for n in (20 * MiB, 2 * MiB, 9 * MiB))
    pool.free(a)                                          # whole: it goes at once
    assert maps(pool) == [(20 * MiB, 2 * MiB), (22 * MiB, 10 * MiB)]
    assert pool.cached_bytes() == MiB                     # b's last MiB: its allocation is used
    pool.free(b)                                          # now whole: it goes
    assert maps(pool) == [(20 * MiB, 2 * MiB)] and pool.device.counters()["unmaps"] == 2
    pool.free(c)

    # A growth of 21 MiB at the edge would pass 40 MiB: the whole free allocation goes first.
    grown = kept + [(34 * MiB, 22 * MiB)]
    pool = sim(expandable_segments=True, capacity=GiB, limit=40 * MiB, max_map_size=GiB)
    live = fill(pool)
    live.append(pool.alloc(21 * MiB))
    assert live[-1] == BASE + 34 * MiB and maps(pool) == grown
    assert pool.reserved_bytes() == 36 * MiB
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(8 * MiB + 512)                         # 10 more, and nothing whole is free
    assert maps(pool) == grown

    pool = sim(expandable_segments=True, capacity=100 * MiB, garbage_collection_threshold=0.4)
    fill(pool)
    pool.alloc(21 * MiB)
    assert maps(pool) == grown

    pool = sim(expandable_segments=True, capacity=40 * MiB)   # ranges of 40 MiB
    fill(pool)
    assert pool.alloc(21 * MiB) == BASE + 40 * MiB        # a new range; the device is out of
    assert maps(pool) == kept and maps(pool, 1) == [(0, 22 * MiB)]   # memory: the free
    assert pool.stats()["num_alloc_retries"] == 1         # allocation goes, the retry maps

    pool = sim(expandable_segments=True, capacity=GiB)
    for p in fill(pool, S):
        pool.free(p, S)
    pool.forget_stream(S)                                 # four allocations, one run
    assert pool.reserved_bytes() == 0 and pool.layout() == []
    assert pool.device.counters()["split_unmaps"] == 0
    assert pool.device.counters()["errors"] == 0


def test_the_high_water_rule_releases_whole_idle_allocations(sim):
    pool = sim(expandable_segments=True, capacity=GiB)
    a = pool.alloc(64 * MiB)                              # one allocation
    b = pool.alloc(2 * MiB)
    pool.free(a)                                          # 64 MiB idle, whole
    c = pool.alloc(80 * MiB)                              # past the mark (66): a's goes first
    assert c == BASE + 66 * MiB                           # the hole is too small: the edge
    assert pool.device.counters()["unmaps"] == 1 and pool.stats()["num_stream_syncs"] == 1
    assert pool.reserved_bytes() == 82 * MiB              # not 146
    assert maps(pool) == [(64 * MiB, 2 * MiB), (66 * MiB, 80 * MiB)]
    assert pool.device.counters()["split_unmaps"] == 0
    pool.free(b)
    pool.free(c)


def test_a_pool_under_a_limit_maps_one_allocation_per_page_unless_told(sim):
    """Under a limit every free page must be able to go: one allocation per page by default
    (Note [Growth extents]), as many as a growth has pages."""
    for options, expect in [({}, [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, 2 * MiB)]),
                            ({"max_map_size": GiB}, [(0, 6 * MiB)])]:
        pool = sim(expandable_segments=True, capacity=GiB, limit=64 * MiB, **options)
        a = pool.alloc(6 * MiB)
        assert maps(pool) == expect and pool.stats()["num_device_alloc"] == len(expect)
        pool.free(a)


def test_initial_pool_size_is_its_own_allocation_and_stays(sim):
    pool = sim(expandable_segments=True, capacity=GiB, initial_pool_size=10 * MiB)
    assert maps(pool) == [(0, 10 * MiB)]
    a = pool.alloc(16 * MiB)                              # the 10 pinned MiB + 6 more: one map
    assert maps(pool) == [(0, 10 * MiB), (10 * MiB, 6 * MiB)]
    pool.free(a)
    pool.empty_cache()
    assert maps(pool) == [(0, 10 * MiB)] and pool.reserved_bytes() == 10 * MiB


def test_a_failed_map_leaves_no_allocation_behind(sim):
    pool = sim(expandable_segments=True, capacity=GiB, max_map_size=4 * MiB)
    a = pool.alloc(4 * MiB)
    pool.device.fail_next(1)
    b = pool.alloc(12 * MiB)                              # refused once, then retried
    assert pool.stats()["num_alloc_retries"] == 1
    assert maps(pool) == [(0, 4 * MiB), (4 * MiB, 4 * MiB), (8 * MiB, 4 * MiB),
                          (12 * MiB, 4 * MiB)]
    assert pool.device.counters()["live_maps"] == 4
    pool.free(a)
    pool.free(b)


@pytest.mark.parametrize("backend", ["sim", "host"])
def test_the_device_unmaps_only_whole_allocations(backend):
    """The rule the sim and host upstreams hold the core to (mp_upstream.h), called on the
    upstream itself: an unmap that cuts a physical allocation is refused, nothing changes;
    one that covers several whole ones is fine."""
    class Upstream(ctypes.Structure):
        _fields_ = [(n, {"pointer": c_void_p, "int": c_int, "size_t": c_size_t}[k])
                    for n, k in upstream_fields()]

    lib = ctypes.CDLL(_core.__file__)
    make = getattr(lib, f"mp_{backend}_upstream")
    make.argtypes = [c_void_p, c_size_t, c_size_t]
    up = Upstream()
    g = 2 * MiB
    assert make(byref(up), 64 * MiB, g) == 0
    fn = CFUNCTYPE(c_int, c_void_p, c_size_t, c_size_t)
    va = c_size_t()
    assert CFUNCTYPE(c_int, c_void_p, c_size_t, POINTER(c_size_t))(up.va_reserve)(
        up.ctx, 16 * g, byref(va)) == 0
    va = va.value
    m, u = fn(up.map), fn(up.unmap)
    assert m(up.ctx, va, 3 * g) == 0 and m(up.ctx, va + 3 * g, 2 * g) == 0
    EINVAL = 3
    for lo, n in [(va + g, g), (va, g), (va, 4 * g), (va + g, 4 * g), (va + 5 * g, g)]:
        assert u(up.ctx, lo, n) == EINVAL, (lo - va, n)
    assert u(up.ctx, va, 5 * g) == 0                      # both, whole
    assert m(up.ctx, va, 5 * g) == 0 and u(up.ctx, va, 5 * g) == 0
    assert fn(up.va_release)(up.ctx, va, 16 * g) == 0
    CFUNCTYPE(None, c_void_p)(up.destroy)(up.ctx)


def test_max_map_size_is_checked():
    for bad in (0, -1, "abc", 1.5):
        with pytest.raises(ValueError, match="max_map_size"):
            mempool.Pool(backend="sim", expandable_segments=True, max_map_size=bad)
    pool = mempool.Pool.from_conf("backend:sim,expandable_segments:True,max_map_size_mb:64")
    assert pool.options["max_map_size"] == 64 * MiB
    assert mempool.Pool(backend="sim").options["max_map_size"] is None
    json.dumps(pool.options)                              # plain values, as every option
