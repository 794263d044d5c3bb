"""Bad input: a clear exception naming the argument, and no change to the pool."""
import pytest

import mempool
from _support import MiB


def snapshot(pool):
    return pool.layout(), {k: v for k, v in pool.stats().items()}


@pytest.fixture
def busy_pool(sim):
    pool = sim()
    live = [pool.alloc(n) for n in (512, 4096, 3 * MiB)]
    pool.free(live.pop(1))
    return pool, live


@pytest.mark.parametrize("nbytes, exc, words", [
    (-1, ValueError, "nbytes must be >= 0"),
    (1.5, TypeError, "nbytes must be an integer"),
    (4096.0, TypeError, "float"),
    ("4096", TypeError, "str"),
    (None, TypeError, "NoneType"),
    (True, TypeError, "bool"),
    (2 ** 64, ValueError, "out of range"),
    (2 ** 70, ValueError, "out of range"),
])
def test_bad_sizes(busy_pool, nbytes, exc, words):
    pool, _ = busy_pool
    before = snapshot(pool)
    with pytest.raises(exc, match=words):
        pool.alloc(nbytes)
    assert snapshot(pool) == before


@pytest.mark.parametrize("nbytes", [2 ** 63, 2 ** 64 - 1, 81 << 30])
def test_sizes_beyond_the_device_are_out_of_memory(busy_pool, nbytes):
    pool, _ = busy_pool
    layout = pool.layout()
    with pytest.raises(mempool.OutOfMemoryError) as info:
        pool.alloc(nbytes)
    assert isinstance(info.value, MemoryError)
    assert "tried to allocate" in str(info.value)
    assert pool.layout() == layout
    pool.free(pool.alloc(1024))                     # still usable


@pytest.mark.parametrize("kind", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                  "uint64", "0-d array"])
def test_numpy_integers_are_sizes_and_pointers(sim, kind):
    """A NumPy integer is the size it holds, the pointer it holds and the stream it names
    (a 0-d array: the size and the pointer; as a stream an array is refused, it has
    __dlpack__): a pool given them ends exactly as a twin given the same Python ints."""
    np = pytest.importorskip("numpy")
    if kind == "0-d array":
        as_np, as_stream = (lambda v: np.array(v, dtype=np.uint64)), int
    else:
        as_np = as_stream = getattr(np, kind)
    sizes = [100, 127] if kind in ("int8", "uint8") else [100, 4096, 30_000]
    mine, twin = sim(), sim()
    ptrs = [mine.alloc(as_np(n), stream=as_stream(5)) for n in sizes]
    want = [twin.alloc(n, stream=5) for n in sizes]
    assert ptrs == want and all(type(p) is int for p in ptrs)
    info = [mine.block_info(p) for p in ptrs]
    assert info == [twin.block_info(p) for p in want]
    assert [(requested, stream) for _, requested, stream in info] == [(n, 5) for n in sizes]
    held = np.array(ptrs[0], dtype=np.uint64)       # a pointer held by NumPy (64 bits wide)
    if kind != "0-d array":
        held = held[()]                              # the np.uint64 scalar
    mine.record_stream(held, as_stream(9))
    mine.free(held, stream=as_stream(5))
    twin.record_stream(want[0], 9)
    twin.free(want[0], stream=5)
    assert mine.layout() == twin.layout() and mine.stats() == twin.stats()


@pytest.mark.parametrize("value, exc, words", [
    ("float64", TypeError, "nbytes must be an integer number of bytes, got float64"),
    ("bool_", TypeError, "nbytes must be an integer number of bytes, got bool"),
    ("negative", ValueError, "nbytes must be >= 0, got -1"),
])
def test_numpy_values_that_are_not_sizes_are_refused(busy_pool, value, exc, words):
    np = pytest.importorskip("numpy")
    nbytes = {"float64": np.float64(4096.0), "bool_": np.bool_(True),
              "negative": np.int64(-1)}[value]
    pool, _ = busy_pool
    before = snapshot(pool)
    with pytest.raises(exc, match=words):
        pool.alloc(nbytes)
    assert snapshot(pool) == before


@pytest.mark.parametrize("offset, words", [
    (None, "not a live pointer"),          # never allocated here
    (256, "inside a live block"),          # interior of a live block
])
def test_bad_pointers(busy_pool, offset, words):
    pool, live = busy_pool
    ptr = 0xDEAD0000 if offset is None else live[1] + offset
    before = snapshot(pool)
    with pytest.raises(ValueError, match=words):
        pool.free(ptr)
    with pytest.raises(ValueError, match=words):
        pool.record_stream(ptr, 5)
    assert snapshot(pool) == before


def test_double_free(busy_pool):
    pool, live = busy_pool
    pool.free(live[0])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(live[0])
    assert snapshot(pool) == before


def test_free_after_its_segment_was_released(sim):
    pool = sim()
    a = pool.alloc(4096)
    pool.free(a)
    pool.empty_cache()
    with pytest.raises(ValueError, match="not a live pointer"):
        pool.free(a)


@pytest.mark.parametrize("ptr, exc", [(-5, ValueError), (1.0, TypeError), ("0x10", TypeError),
                                      (2 ** 64, ValueError), (None, TypeError),
                                      (True, TypeError)])
def test_bad_pointer_types(busy_pool, ptr, exc):
    pool, _ = busy_pool
    before = snapshot(pool)
    with pytest.raises(exc, match="ptr"):
        pool.free(ptr)
    assert snapshot(pool) == before


def test_bad_pointer_types_on_a_fresh_pool(sim):
    """Note [Hot address]: before any alloc or free, the remembered address is no match for
    a bad argument either."""
    pool = sim()
    for ptr in (None, True, 0.0):
        with pytest.raises(TypeError, match="ptr"):
            pool.free(ptr)
    with pytest.raises(ValueError, match="not a live pointer"):
        pool.free(0)


@pytest.mark.parametrize("stream, exc, words", [
    (-1, ValueError, "stream must be a handle"),
    ("s", TypeError, "stream must be"),
    (1.5, TypeError, "stream must be"),
    (object(), TypeError, "stream must be"),
    (2 ** 64, ValueError, "stream must be a handle"),
])
def test_bad_streams(busy_pool, stream, exc, words):
    pool, live = busy_pool
    before = snapshot(pool)
    with pytest.raises(exc, match=words):
        pool.alloc(512, stream=stream)
    with pytest.raises(exc, match=words):
        pool.free(live[0], stream=stream)
    with pytest.raises(exc, match=words):
        pool.record_stream(live[0], stream)
    assert snapshot(pool) == before


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(backend="gpu"), ValueError, "backend"),
    (dict(backend="sim", frobnicate=1), ValueError, "frobnicate"),
    (dict(backend="sim", max_split_size="lots"), ValueError, "max_split_size"),
    (dict(backend="sim", limit=-3), ValueError, "limit"),
    (dict(backend="sim", roundup_power2_divisions=3), ValueError, "roundup_power2_divisions"),
    (dict(backend="sim", device=-1), ValueError, "device"),
    (dict(backend="sim", granularity=1000), ValueError, "granularity"),
    (dict(backend="sim", garbage_collection_threshold=1.5), ValueError, "garbage_collection"),
])
def test_bad_options(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        mempool.Pool(**kwargs)


def test_errors_leave_a_usable_pool(busy_pool):
    pool, live = busy_pool
    for bad in (-1, 2 ** 64, "x"):
        with pytest.raises((ValueError, TypeError)):
            pool.alloc(bad)
    ptr = pool.alloc(4096)
    pool.free(ptr)
    for p in live:
        pool.free(p)
    assert pool.used_bytes() == 0
