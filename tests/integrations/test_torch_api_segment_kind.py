"""Note [Segment kind at run time] (glue/mp_torch_private.c), on `sim`, through the C table:
the per-device flag the C++ allocator reads at each allocation, and the companion pool of
the other segment kind it allocates from while PyTorch's expandable_segments setting
differs from the device pool's kind. The C++ routing itself runs on the GPU
(tests/gpu/test_gpu_torch_segment_kind.py)."""
import ctypes

import pytest

import mempool
from mempool import _core
from test_torch_api_table import (DEVICE, F, MP_EINVAL, MP_ELIMIT, MP_OK, Layout, MiB, i32,
                                  sz, u, vp)
from test_torch_api_table import api  # noqa: F401  (fixture)



def pool_functions(api):
    """pool_alloc, pool_free, pool_empty_cache, pool_reserved_bytes, pool_layout,
    layout_free and pool_release of the table, by name."""
    return dict(
        alloc=F(i32, vp, sz, u, ctypes.POINTER(u))(api.pool_fn_0),
        free=F(i32, vp, u, u, i32)(api.pool_fn_1),
        empty_cache=F(i32, vp)(api.pool_fn_8),
        reserved=F(sz, vp)(api.pool_fn_10),
        layout=F(i32, vp, ctypes.POINTER(Layout))(api.pool_fn_12),
        layout_free=F(None, ctypes.POINTER(Layout))(api.pool_fn_13),
        release=F(None, vp)(api.pool_fn_14))


def expandable_flags(fn, pool):
    """is_expandable of each segment in `pool`'s layout."""
    layout = Layout()
    assert fn["layout"](pool, ctypes.byref(layout)) == MP_OK
    flags = [layout.segments[i].is_expandable for i in range(layout.nsegments)]
    fn["layout_free"](ctypes.byref(layout))
    return flags


@pytest.fixture
def device_pool():
    pools = []

    def make(**options):
        pool = mempool.Pool(backend="sim", capacity="1GiB", device=DEVICE, **options)
        _core._torch_register(DEVICE, pool)
        pools.append(pool)
        return pool
    yield make
    _core._torch_set_expandable(DEVICE, False)
    if pools:
        pools[-1].empty_cache()
    _core._torch_unregister(DEVICE)


def test_the_flag_follows_the_setting_and_the_registered_pools_kind(api, device_pool):
    flags = api.kind_switched
    device_pool()                                        # fixed segments
    assert flags[DEVICE] == 0
    assert _core._torch_set_expandable(DEVICE, True) is True
    assert flags[DEVICE] == 1 and _core._torch_kind_switched(DEVICE)
    assert _core._torch_set_expandable(DEVICE, False) is False
    assert flags[DEVICE] == 0
    _core._torch_set_expandable(DEVICE, True)
    _core._torch_unregister(DEVICE)
    assert flags[DEVICE] == 0                            # no pool: nothing to switch from
    device_pool(expandable_segments=True)                # made the asked kind
    assert flags[DEVICE] == 0
    _core._torch_set_expandable(DEVICE, False)
    assert flags[DEVICE] == 1
    assert flags[DEVICE + 1] == 0                        # one device's setting only


@pytest.mark.parametrize("expandable", [False, True])
def test_the_companion_is_the_other_kind_with_the_devices_options(api, device_pool,
                                                                  expandable):
    pool = device_pool(expandable_segments=expandable, roundup_power2_divisions=4)
    fn = pool_functions(api)
    companion = vp()
    assert api.companion_pool_create(DEVICE, ctypes.byref(companion)) == MP_OK
    try:
        out = u()
        nbytes = 4 * MiB + 512 * 1024
        assert fn["alloc"](companion, nbytes, 0, ctypes.byref(out)) == MP_OK
        assert expandable_flags(fn, companion) == [int(not expandable)]
        assert pool.used_bytes() == 0                    # the device pool was not asked
        # The device pool's rounding: quarters of the power-of-two interval [4, 8) MiB.
        size, requested, stream = sz(), sz(), u()
        info = F(i32, vp, u, ctypes.POINTER(sz), ctypes.POINTER(sz), ctypes.POINTER(u))(
            api.pool_fn_4)
        assert info(companion, out.value, ctypes.byref(size), ctypes.byref(requested),
                    ctypes.byref(stream)) == MP_OK
        assert (size.value, requested.value) == (5 * MiB, nbytes)
        assert fn["free"](companion, out.value, 0, 0) == MP_OK
        assert fn["empty_cache"](companion) == MP_OK
        assert fn["reserved"](companion) == 0
    finally:
        fn["release"](companion)
    pool.check_invariants()


def test_the_companion_shares_the_device_pools_limit(api, device_pool):
    # Note [Shared limit]: the memory fraction caps the device, whichever pool holds it.
    pool = device_pool()
    pool.set_limit(64 * MiB)
    fn = pool_functions(api)
    companion = vp()
    assert api.companion_pool_create(DEVICE, ctypes.byref(companion)) == MP_OK
    try:
        held = pool.alloc(40 * MiB)
        out = u()
        assert fn["alloc"](companion, 32 * MiB, 0, ctypes.byref(out)) == MP_ELIMIT
        pool.free(held)
        pool.empty_cache()                               # the room the companion needs
        assert fn["alloc"](companion, 32 * MiB, 0, ctypes.byref(out)) == MP_OK
        with pytest.raises(mempool.OutOfMemoryError):
            pool.alloc(40 * MiB)                         # and the other way round
        assert fn["free"](companion, out.value, 0, 0) == MP_OK
    finally:
        fn["release"](companion)


def test_the_companion_outlives_the_device_pools_registration(api, device_pool):
    # Its segments come from the device pool's upstream, borrowed: the companion holds the
    # device pool, so the upstream is there for every segment it frees.
    device_pool()
    fn = pool_functions(api)
    companion = vp()
    assert api.companion_pool_create(DEVICE, ctypes.byref(companion)) == MP_OK
    out = u()
    assert fn["alloc"](companion, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    _core._torch_unregister(DEVICE)                      # the table's reference goes
    import gc
    gc.collect()
    assert fn["free"](companion, out.value, 0, 0) == MP_OK
    assert fn["alloc"](companion, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    fn["release"](companion)                             # frees its segment, then the pool


def test_the_companion_follows_the_device_pools_size_policy(api, device_pool):
    # Note [Private pools follow the size policy]; an expandable companion takes no split
    # limit (PyTorch ignores it for expandable segments) but the collection threshold.
    pool = device_pool()
    fn = pool_functions(api)
    companion = vp()
    assert api.companion_pool_create(DEVICE, ctypes.byref(companion)) == MP_OK
    try:
        pool.set_size_policy(roundup_power2_divisions=2, max_split_size="64MiB",
                             garbage_collection_threshold=0.5)
        assert _core._torch_follow_size_policy(pool) is True
        out, size, requested, stream = u(), sz(), sz(), u()
        info = F(i32, vp, u, ctypes.POINTER(sz), ctypes.POINTER(sz), ctypes.POINTER(u))(
            api.pool_fn_4)
        assert fn["alloc"](companion, 5 * MiB, 0, ctypes.byref(out)) == MP_OK
        assert info(companion, out.value, ctypes.byref(size), ctypes.byref(requested),
                    ctypes.byref(stream)) == MP_OK
        assert size.value == 6 * MiB                     # halves of [4, 8) MiB
        assert fn["free"](companion, out.value, 0, 0) == MP_OK
    finally:
        fn["release"](companion)


def test_companion_refusals_are_codes(api):
    companion = vp()
    assert api.companion_pool_create(DEVICE, ctypes.byref(companion)) == MP_EINVAL  # no pool
    assert api.companion_pool_create(-1, ctypes.byref(companion)) == MP_EINVAL
    assert api.companion_pool_create(DEVICE, None) == MP_EINVAL
    assert companion.value is None


def test_a_companions_block_shares_and_its_captures_count(api, device_pool):
    device_pool()
    fn = pool_functions(api)
    companion = vp()
    assert api.companion_pool_create(DEVICE, ctypes.byref(companion)) == MP_OK
    try:
        out = u()
        assert fn["alloc"](companion, 2 * MiB, 0, ctypes.byref(out)) == MP_OK
        buf = (ctypes.c_ubyte * 512)()
        length, offset = sz(), sz()
        assert api.pool_share(companion, out.value, buf, 512, ctypes.byref(length),
                              ctypes.byref(offset)) == MP_OK
        assert 0 < length.value <= 512
        assert api.pool_capture_end(companion) == MP_EINVAL   # none begun
        assert api.pool_capture_begin(companion) == MP_OK
        assert api.pool_capture_end(companion) == MP_OK
        assert fn["free"](companion, out.value, 0, 0) == MP_OK
    finally:
        fn["release"](companion)
