"""The CuPy allocator hook on the simulated device: ``pool.malloc`` hands CuPy a
``MemoryPointer`` on a pool block, and CuPy dropping it frees the block (no GPU needed)."""
import gc
import weakref

import pytest

import mempool

cupy = pytest.importorskip("cupy", reason="the hook builds CuPy MemoryPointers")


def test_malloc_returns_a_memory_pointer_on_a_pool_block(sim):
    pool = sim()
    mp = pool.malloc(1000)
    assert isinstance(mp, cupy.cuda.MemoryPointer)
    assert mp.mem.size == 1000 and mp.ptr == mp.mem.ptr
    nbytes, requested, stream = pool.block_info(mp.ptr)
    assert (nbytes, requested, stream) == (1024, 1000, 0)
    assert pool.used_bytes() == 1024
    del mp
    assert pool.used_bytes() == 0
    pool.check_invariants()


def test_views_keep_the_block_until_the_last_goes(sim):
    pool = sim()
    mp = pool.malloc(4096)
    view = mp + 512                      # CuPy's offset pointer shares the memory object
    del mp
    gc.collect()
    assert pool.used_bytes() == 4096
    del view
    assert pool.used_bytes() == 0


def test_a_memory_pointer_keeps_its_pool_alive():
    pool = mempool.Pool(backend="sim")
    alive = weakref.ref(pool)
    mp = pool.malloc(512)
    del pool
    gc.collect()
    assert alive() is not None           # the block's owner holds the pool
    alive().check_invariants()
    del mp
    gc.collect()
    assert alive() is None


def test_zero_bytes_is_cupys_null_pointer(sim):
    pool = sim()
    mp = pool.malloc(0)
    assert mp.ptr == 0 and mp.mem.size == 0
    assert pool.used_bytes() == 0 and pool.stats()["allocation.all.allocated"] == 0


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), ("64", TypeError),
                                        (2 ** 64, ValueError)])
def test_bad_sizes_are_refused_and_change_nothing(sim, bad, error):
    pool = sim()
    with pytest.raises(error, match="nbytes"):
        pool.malloc(bad)
    assert pool.used_bytes() == 0 and pool.reserved_bytes() == 0
    pool.check_invariants()


def test_out_of_memory_is_an_out_of_memory_error(sim):
    pool = sim(capacity=64 << 20)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.malloc(1 << 30)
    assert pool.used_bytes() == 0
    pool.check_invariants()


def test_use_sets_and_restores_cupys_allocator(sim):
    pool = sim()
    before = cupy.cuda.get_allocator()
    with pool.use() as used:
        assert used is pool
        assert cupy.cuda.get_allocator() == pool.malloc
    assert cupy.cuda.get_allocator() == before
