"""The C table the C++ PyTorch allocator reaches the pools through (mp_torch.h), on `sim`.

The glue itself needs PyTorch's CUDA headers and a GPU (tests/gpu/test_gpu_torch_*.py);
everything it asks of the core goes through this table, so the table is checked here, with
ctypes playing the glue: routing by device, the codes instead of NULLs, statistics that match
``Pool.stats()``, the figures of an OOM report, and the layout that snapshots are built from.
What the glue is told of segments, and pools with segment sources of their own, are in
tests/integrations/test_torch_api_segments.py.
"""
import ctypes

import pytest

import mempool
from mempool import _core
from _core_config import Config

MiB = 1 << 20
DEVICE = 7            # a slot no other test uses
MP_OK, MP_ENOMEM, MP_ELIMIT, MP_EINVAL = 0, 1, 2, 3

u, sz, i32, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p


class Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64),
                ("allocated", ctypes.c_int64), ("freed", ctypes.c_int64)]


FAMILIES = ["allocation", "segment", "active", "inactive_split", "allocated_bytes",
            "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"]


class Stats(ctypes.Structure):
    _fields_ = ([(f, Stat * 3) for f in FAMILIES]
                + [(f, Stat) for f in ("oversize_allocations", "oversize_segments",
                                       "mapped_bytes", "va_reserved_bytes")]
                + [(f, u) for f in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                    "num_device_alloc", "num_device_free",
                                    "num_cross_stream_reuse", "num_event_waits",
                                    "num_streams", "num_stream_syncs", "num_event_records",
                                    "num_stream_queries", "num_ahead_maps",
                                    "num_behind_unmaps")])


class BlockView(ctypes.Structure):
    _fields_ = [("ptr", u), ("nbytes", sz), ("requested", sz), ("last_requested", sz),
                ("stream", u), ("state", i32)]


class SegmentView(ctypes.Structure):
    _fields_ = [("ptr", u), ("nbytes", sz), ("mapped_bytes", sz), ("stream", u),
                ("is_small", i32), ("is_expandable", i32), ("is_pinned", i32),
                ("first_block", sz), ("nblocks", sz), ("first_map", sz), ("nmaps", sz)]


class Layout(ctypes.Structure):
    _fields_ = [("segments", ctypes.POINTER(SegmentView)), ("nsegments", sz),
                ("blocks", ctypes.POINTER(BlockView)), ("nblocks", sz),
                ("maps", ctypes.POINTER(u)), ("nmaps", sz)]


F = ctypes.CFUNCTYPE
FIELDS = [
    ("version", i32), ("max_devices", i32), ("struct_size", sz),
    ("alloc", F(i32, i32, sz, u, ctypes.POINTER(u))),
    ("free", F(None, i32, u)),
    ("find_device", F(i32, u)),
    ("record_stream", F(i32, i32, u, u)),
    ("base_allocation", F(i32, i32, u, ctypes.POINTER(u), ctypes.POINTER(sz))),
    ("stats", F(i32, i32, ctypes.POINTER(Stats))),
    ("reset_peak_stats", F(i32, i32)),
    ("reset_accumulated_stats", F(i32, i32)),
    ("empty_cache", F(i32, i32)),
    ("memory_figures", F(i32, i32, ctypes.c_void_p)),   # mp_torch_figures *, below
    ("set_limit", F(i32, i32, sz)),
    ("mem_info", F(i32, i32, ctypes.POINTER(sz), ctypes.POINTER(sz))),
    ("layout", F(i32, i32, ctypes.POINTER(Layout))),
    ("enable_peer_access", F(i32, i32, i32)),
    ("capture_begin", F(i32, i32)),
    ("capture_end", F(i32, i32)),
    ("private_pool_create", F(i32, i32, ctypes.POINTER(vp))),
]
# The pool_* members follow; their count pins the struct's size.
N_POOL_FUNCTIONS = 15


PoolArray = ctypes.POINTER(vp)
DEVICE_PEAK_FIELDS = [
    ("private_event", F(i32, i32, PoolArray, sz)),
    ("device_stats", F(i32, i32, PoolArray, sz, ctypes.POINTER(Stats))),
    ("device_reset_peak_stats", F(i32, i32, PoolArray, sz)),
]
# Note [Segment observer] (mp_core.h): fn(ctx, pool, action, ptr, nbytes, stream).
Observer = F(None, vp, vp, i32, u, sz, u)
OBSERVER_FIELDS = [
    ("set_segment_observer", F(None, Observer, vp)),
    ("pool_device", F(i32, vp)),
]


CONFIG_FIELDS = [("config", F(i32, i32, ctypes.POINTER(Config)))]


class Source(ctypes.Structure):   # mp_segment_source (Note [Custom segment sources])
    _fields_ = [("ctx", vp), ("alloc", F(i32, vp, sz, u, ctypes.POINTER(u))),
                ("free", F(None, vp, u, sz, u)), ("release", F(None, vp))]


CUSTOM_FIELDS = [("custom_pool_create", F(i32, i32, ctypes.POINTER(Source), ctypes.POINTER(vp))),
                 ("pool_set_no_split", F(i32, vp)),
                 ("block_info", F(i32, i32, u, ctypes.POINTER(sz), ctypes.POINTER(sz),
                                  ctypes.POINTER(u)))]
SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP = 3, 4, 6, 7
# Note [Release observer] (mp_core.h): fn(ctx, pool), with no lock held.
ReleaseObserver = F(None, vp, vp)
RELEASE_FIELDS = [("set_release_observer", F(None, ReleaseObserver, vp))]


class Figures(ctypes.Structure):   # mp_torch_figures
    _fields_ = [(f, sz) for f in ("reserved", "used", "cached", "largest_free_block", "limit",
                                  "capacity", "max_split_size")]


class OomRecord(ctypes.Structure):   # mp_oom (mp_core.h)
    _fields_ = [("pool", vp), ("code", i32), ("nbytes", sz), ("rounded", sz), ("stream", u),
                ("reserved_bytes", sz), ("used_bytes", sz), ("pending_bytes", sz),
                ("cached_bytes", sz), ("largest_free_block", sz), ("limit", sz),
                ("capacity", sz), ("capturing", i32), ("num_ooms", u)]


# Note [One OOM explainer] (core/mp_oom.c).
OOM_FIELDS = [("oom_message", F(i32, i32, vp, i32, sz, u, ctypes.POINTER(OomRecord),
                                ctypes.c_char_p, sz))]


# Note [Sharing across processes] (core/mp_share.c): tested in test_torch_api_share.py.
Bytes = ctypes.POINTER(ctypes.c_ubyte)
SHARE_FIELDS = [("share", F(i32, i32, u, Bytes, sz, ctypes.POINTER(sz), ctypes.POINTER(sz))),
                ("share_open", F(i32, i32, Bytes, sz, ctypes.POINTER(u), ctypes.POINTER(sz))),
                ("share_close", F(i32, i32, u))]


# Note [Segment kind at run time] (mp_torch_private.c): tested in
# test_torch_api_segment_kind.py.
SEGMENT_KIND_FIELDS = [
    ("kind_switched", ctypes.POINTER(i32)),
    ("companion_pool_create", F(i32, i32, ctypes.POINTER(vp))),
    ("pool_share", F(i32, vp, u, Bytes, sz, ctypes.POINTER(sz), ctypes.POINTER(sz))),
    ("pool_capture_begin", F(i32, vp)),
    ("pool_capture_end", F(i32, vp)),
]


class Api(ctypes.Structure):
    _fields_ = (FIELDS + [(f"pool_fn_{i}", vp) for i in range(N_POOL_FUNCTIONS)]
                + DEVICE_PEAK_FIELDS + OBSERVER_FIELDS + CONFIG_FIELDS + CUSTOM_FIELDS
                + RELEASE_FIELDS + OOM_FIELDS + SHARE_FIELDS + SEGMENT_KIND_FIELDS)


@pytest.fixture
def api():
    table = Api.from_address(_core._torch_api_address())
    assert table.version == 12
    assert table.struct_size == ctypes.sizeof(Api), "the table's layout changed: update Api"
    yield table


@pytest.fixture
def routed():
    pool = mempool.Pool(backend="sim", capacity="1GiB", device=DEVICE)
    _core._torch_register(DEVICE, pool)
    yield pool
    pool.empty_cache()
    _core._torch_unregister(DEVICE)
    pool.check_invariants()


def stats_of(api, device):
    s = Stats()
    assert api.stats(device, ctypes.byref(s)) == MP_OK
    return s


def test_alloc_and_free_route_by_device_and_match_pool_stats(api, routed):
    out = u()
    assert api.alloc(DEVICE, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    assert routed.used_bytes() >= 3 * MiB
    assert api.find_device(out.value) == DEVICE
    s = stats_of(api, DEVICE)
    py = routed.stats()
    assert s.allocated_bytes[0].current == py["allocated_bytes.all.current"] >= 3 * MiB
    assert s.reserved_bytes[0].current == py["reserved_bytes.all.current"]
    assert s.requested_bytes[0].current == 3 * MiB
    base, nbytes = u(), sz()
    assert api.base_allocation(DEVICE, out.value, ctypes.byref(base), ctypes.byref(nbytes)) == 0
    assert base.value == out.value and nbytes.value >= 3 * MiB
    api.free(DEVICE, out.value)
    assert routed.used_bytes() == 0
    assert api.find_device(out.value) == -1


def test_block_info_gives_a_blocks_size_requested_size_and_stream(api, routed):
    # A free's trace entry carries the size the block was asked for, as the alloc's does.
    out, nbytes, requested, stream = u(), sz(), sz(), u()
    assert api.alloc(DEVICE, 1000, 0, ctypes.byref(out)) == MP_OK
    assert api.block_info(DEVICE, out.value, ctypes.byref(nbytes), ctypes.byref(requested),
                          ctypes.byref(stream)) == MP_OK
    assert (nbytes.value, requested.value, stream.value) == (1024, 1000, 0)
    api.free(DEVICE, out.value)
    assert api.block_info(DEVICE, out.value, ctypes.byref(nbytes), ctypes.byref(requested),
                          ctypes.byref(stream)) == 4                     # MP_ENOTFOUND
    assert api.block_info(DEVICE + 1, out.value, ctypes.byref(nbytes), ctypes.byref(requested),
                          ctypes.byref(stream)) == MP_EINVAL              # no pool there


def test_an_unrouted_device_is_a_code_not_a_crash(api):
    out = u()
    for device in (DEVICE + 1, -1, 64, 1 << 30):
        assert api.alloc(device, MiB, 0, ctypes.byref(out)) == MP_EINVAL
        assert api.stats(device, ctypes.byref(Stats())) == MP_EINVAL
        assert api.empty_cache(device) == MP_EINVAL
    api.free(DEVICE + 1, 12345)       # ignored


def test_oom_codes_and_the_figures_of_the_report(api, routed):
    routed.set_limit(64 * MiB)
    out = u()
    assert api.alloc(DEVICE, 128 * MiB, 0, ctypes.byref(out)) == MP_ELIMIT
    assert routed.used_bytes() == 0
    fig = Figures()
    assert api.memory_figures(DEVICE, ctypes.addressof(fig)) == MP_OK
    assert (fig.limit, fig.capacity) == (64 * MiB, 1 << 30)
    assert fig.used == 0 and fig.reserved == routed.reserved_bytes()
    assert fig.cached == routed.cached_bytes()
    assert fig.largest_free_block == routed.largest_free_block()
    assert fig.max_split_size == (1 << 64) - 1   # unlimited, read by PyTorch as -1
    assert api.set_limit(DEVICE, (1 << 64) - 1) == MP_OK
    assert api.alloc(DEVICE, 128 * MiB, 0, ctypes.byref(out)) == MP_OK
    api.free(DEVICE, out.value)


def test_peaks_reset_and_cache_release(api, routed):
    out = u()
    assert api.alloc(DEVICE, 8 * MiB, 0, ctypes.byref(out)) == MP_OK
    api.free(DEVICE, out.value)
    assert stats_of(api, DEVICE).allocated_bytes[0].peak >= 8 * MiB
    assert api.reset_peak_stats(DEVICE) == MP_OK
    assert stats_of(api, DEVICE).allocated_bytes[0].peak == 0
    assert api.reset_accumulated_stats(DEVICE) == MP_OK
    assert stats_of(api, DEVICE).allocation[0].allocated == 0
    assert routed.reserved_bytes() > 0
    assert api.empty_cache(DEVICE) == MP_OK
    assert routed.reserved_bytes() == 0


S1 = 7   # a stream handle (the sim accepts any integer)


def kept_behind_queued_work(pool, nbytes):
    """A cached segment of `pool` whose stream has work queued: empty_cache frees it
    behind that work, and the sim keeps its bytes the device's until the work has run
    (Note [Frees the driver keeps])."""
    pool.free(pool.alloc(nbytes, stream=S1), stream=S1)
    pool.device.launch(S1)


def test_empty_cache_gives_the_device_back_what_it_kept_of_the_frees(api, routed):
    # Note [Giving back to the device]: torch.cuda.empty_cache() promises the memory back
    # to the device. The pool's frees are stream-ordered and wait for nothing, so after its
    # release the device still held 12 MiB; the table's empty_cache now waits for the
    # device (one sync, counted as PyTorch counts its own) and the device holds nothing.
    kept_behind_queued_work(routed, 12 * MiB)
    syncs = routed.device.counters()["syncs"]
    assert api.empty_cache(DEVICE) == MP_OK
    assert routed.reserved_bytes() == 0
    assert routed.device.held_bytes == 0
    assert routed.device.counters()["syncs"] == syncs + 1
    assert routed.stats()["num_sync_all_streams"] == 1
    # The Pool's own empty_cache, for comparison, leaves them kept on sim (on cuda it
    # synchronizes and trims its cudaMemPool through the CUDA runtime).
    kept_behind_queued_work(routed, 12 * MiB)
    routed.empty_cache()
    assert routed.device.held_bytes == 12 * MiB
    routed.device.complete_all()


def test_empty_cache_with_nothing_released_makes_no_sync(api, routed):
    kept_behind_queued_work(routed, 4 * MiB)
    assert api.empty_cache(DEVICE) == MP_OK
    syncs = routed.device.counters()["syncs"]
    routed.device.launch(S1)
    assert api.empty_cache(DEVICE) == MP_OK        # nothing cached: nothing to give back
    assert routed.device.counters()["syncs"] == syncs
    assert routed.stats()["num_sync_all_streams"] == 1
    routed.device.complete_all()


def test_empty_cache_during_a_capture_waits_for_no_device(api, routed):
    # A capture refuses a device sync and is broken by one: the give-back waits for the
    # capture's end (the release itself is deferred by the core, Note [Graph capture]).
    kept_behind_queued_work(routed, 8 * MiB)
    assert api.capture_begin(DEVICE) == MP_OK
    syncs = routed.device.counters()["syncs"]
    assert api.empty_cache(DEVICE) == MP_OK
    assert routed.device.counters()["syncs"] == syncs
    assert api.capture_end(DEVICE) == MP_OK
    assert api.empty_cache(DEVICE) == MP_OK
    assert routed.device.held_bytes == 0 and routed.reserved_bytes() == 0
    assert routed.device.counters()["syncs"] == syncs + 1


def test_layout_covers_every_segment(api, routed):
    ptrs = []
    for n in (512, 4096, 3 * MiB, 12 * MiB):
        out = u()
        assert api.alloc(DEVICE, n, 0, ctypes.byref(out)) == MP_OK
        ptrs.append(out.value)
    lay = Layout()
    assert api.layout(DEVICE, ctypes.byref(lay)) == MP_OK
    try:
        total = sum(lay.segments[i].nbytes for i in range(lay.nsegments))
        assert total == routed.reserved_bytes()
        allocated = {lay.blocks[i].ptr for i in range(lay.nblocks) if lay.blocks[i].state == 1}
        assert allocated == set(ptrs)
        for i in range(lay.nsegments):       # blocks tile their segment end to end
            seg = lay.segments[i]
            addr = seg.ptr
            for b in range(seg.first_block, seg.first_block + seg.nblocks):
                assert lay.blocks[b].ptr == addr
                addr += lay.blocks[b].nbytes
            assert addr == seg.ptr + seg.nbytes
    finally:
        ctypes.CDLL(_core.__file__)   # the extension stays loaded: layout_free is pool fn 13
        free_layout = ctypes.CFUNCTYPE(None, ctypes.POINTER(Layout))(api.pool_fn_13)
        free_layout(ctypes.byref(lay))
    for p in ptrs:
        api.free(DEVICE, p)


def test_record_stream_and_private_pools_need_a_cuda_pool(api, routed):
    out = u()
    assert api.alloc(DEVICE, MiB, 0, ctypes.byref(out)) == MP_OK
    assert api.record_stream(DEVICE, out.value, 0x1234) == MP_OK
    assert api.record_stream(DEVICE, out.value + 512, 0x1234) != MP_OK   # not a block start
    api.free(DEVICE, out.value)
    routed.forget_stream(0x1234)
    handle = vp()
    # Peer access and private pools need the cuda upstream: a sim pool says so, no crash.
    assert api.enable_peer_access(DEVICE, 1) == 9     # MP_EUNSUPPORTED
    # Private pools take plain cuMemAlloc segments: a sim pool has none to give.
    assert api.private_pool_create(DEVICE, ctypes.byref(handle)) == MP_EINVAL
    assert not handle.value


def test_allocation_at_an_address_puts_a_freed_block_back(api, routed):
    """What restoring a cudagraph-trees checkpoint needs (Note [Allocation at an address])."""
    pool_address = _core._torch_pool_address(DEVICE)
    alloc_at = ctypes.CFUNCTYPE(i32, vp, u, sz, u)(api.pool_fn_2)
    a, b, c = u(), u(), u()
    for out in (a, b, c):
        assert api.alloc(DEVICE, 2 * MiB, 0, ctypes.byref(out)) == MP_OK
    api.free(DEVICE, b.value)
    assert alloc_at(pool_address, b.value, 2 * MiB, 0) == MP_OK
    assert api.find_device(b.value) == DEVICE
    assert alloc_at(pool_address, b.value, 2 * MiB, 0) == 10          # MP_EBUSY: taken
    assert alloc_at(pool_address, b.value + 100, 512, 0) == MP_EINVAL  # misaligned
    assert alloc_at(pool_address, 1 << 20, 512, 0) == 4                # MP_ENOTFOUND
    # Inside a free block: its head stays free, the tail is carved.
    api.free(DEVICE, b.value)
    inner = b.value + MiB
    assert alloc_at(pool_address, inner, MiB, 0) == MP_OK
    routed.check_invariants()
    assert routed.stats()["allocation.all.current"] == 3
    for p in (a.value, inner, c.value):
        api.free(DEVICE, p)
    routed.check_invariants()
    assert routed.used_bytes() == 0


def test_capture_begin_and_end_reach_the_device_pool(api, routed):
    """The glue brackets PyTorch's graph captures with these (Note [Graph capture])."""
    routed.set_release_threshold(0)
    assert api.capture_begin(DEVICE) == MP_OK
    out = u()
    assert api.alloc(DEVICE, 4 * MiB, 0, ctypes.byref(out)) == MP_OK
    api.free(DEVICE, out.value)
    assert routed.reserved_bytes() > 0          # nothing is released during a capture
    assert api.capture_end(DEVICE) == MP_OK
    assert routed.reserved_bytes() == 0         # the deferred release happens at the end
    assert api.capture_end(DEVICE) == MP_EINVAL  # no capture begun
    assert api.capture_begin(DEVICE + 1) == MP_EINVAL


PRIVATE_DEVICE = DEVICE + 2   # a slot that only lends the "private" pool's address


@pytest.fixture
def private_pool():
    """A second pool standing for a CUDA graph's private pool (on sim the table makes none:
    private pools take plain CUDA segments); its address comes from a slot of its own."""
    pool = mempool.Pool(backend="sim", capacity="1GiB", device=PRIVATE_DEVICE)
    _core._torch_register(PRIVATE_DEVICE, pool)
    address = _core._torch_pool_address(PRIVATE_DEVICE)
    assert address
    yield pool, (vp * 1)(address)
    pool.empty_cache()
    _core._torch_unregister(PRIVATE_DEVICE)
    pool.check_invariants()


def device_stats_of(api, privates, n=1):
    s = Stats()
    assert api.device_stats(DEVICE, privates, n, ctypes.byref(s)) == MP_OK
    return s


def test_device_peaks_are_the_devices_not_the_sum_of_each_pools(api, routed, private_pool):
    """Note [Device peaks]: the device pool peaks at 200 MiB while the private pool holds
    nothing, then at 180 MiB while it holds 50: the device's peak is 230 MiB (the sum of
    the two pools' peaks, 250, is what the statistics said before), and the device pool's
    own peak stays 200 MiB after the windows the reports closed."""
    priv, privates = private_pool
    out = u()

    def main_round_trip(nbytes):
        assert api.alloc(DEVICE, nbytes, 0, ctypes.byref(out)) == MP_OK
        api.free(DEVICE, out.value)

    main_round_trip(200 * MiB)
    x = priv.alloc(50 * MiB)
    assert api.private_event(DEVICE, privates, 1) == MP_OK
    main_round_trip(180 * MiB)
    # read while the private pool still holds its block: the open window counts too
    s = device_stats_of(api, privates)
    assert s.requested_bytes[0].peak == 230 * MiB
    assert s.requested_bytes[0].current == 50 * MiB
    priv.free(x)
    assert api.private_event(DEVICE, privates, 1) == MP_OK
    main_round_trip(60 * MiB)

    s = device_stats_of(api, privates)
    assert s.requested_bytes[0].peak == 230 * MiB
    assert s.allocated_bytes[0].peak == 230 * MiB        # MiB sizes are not rounded up
    assert s.allocation[0].peak == 2                      # one block of each pool at once
    assert s.requested_bytes[0].current == 0
    own = routed.stats()
    assert own["requested_bytes.all.peak"] == 200 * MiB     # the closed windows are kept
    assert own["requested_bytes.all.allocated"] == 440 * MiB
    assert s.requested_bytes[0].allocated == 490 * MiB      # the two pools' sums
    assert priv.stats()["requested_bytes.all.peak"] == 50 * MiB

    # reset: the device's peaks start again from what both pools hold now
    y = priv.alloc(10 * MiB)
    assert api.private_event(DEVICE, privates, 1) == MP_OK
    assert api.device_reset_peak_stats(DEVICE, privates, 1) == MP_OK
    s = device_stats_of(api, privates)
    assert s.requested_bytes[0].peak == 10 * MiB
    assert routed.stats()["requested_bytes.all.peak"] == 0
    main_round_trip(30 * MiB)
    assert device_stats_of(api, privates).requested_bytes[0].peak == 40 * MiB
    priv.free(y)
    assert api.private_event(DEVICE, privates, 1) == MP_OK
    routed.check_invariants()


def test_device_peaks_without_private_pools_are_the_pools(api, routed):
    out = u()
    for nbytes in (30 * MiB, 70 * MiB, 20 * MiB):
        assert api.alloc(DEVICE, nbytes, 0, ctypes.byref(out)) == MP_OK
        api.free(DEVICE, out.value)
    none = PoolArray()
    s = device_stats_of(api, none, 0)
    py = routed.stats()
    assert s.requested_bytes[0].peak == py["requested_bytes.all.peak"] == 70 * MiB
    assert s.reserved_bytes[0].current == py["reserved_bytes.all.current"]
    assert api.private_event(DEVICE + 1, none, 0) == MP_EINVAL    # no pool there
    assert api.device_stats(DEVICE + 1, none, 0, ctypes.byref(Stats())) == MP_EINVAL


def test_the_config_is_the_device_pools_options(api):
    # The snapshot's allocator_settings come from here: PyTorch's keys, the pool's values.
    pool = mempool.Pool(backend="sim", capacity="1GiB", device=DEVICE,
                        garbage_collection_threshold=0.6, max_split_size="64MiB",
                        roundup_power2_divisions={256: 1, ">": 8})
    _core._torch_register(DEVICE, pool)
    try:
        cfg = Config()
        assert api.config(DEVICE, ctypes.byref(cfg)) == MP_OK
        assert cfg.gc_threshold == 0.6
        assert cfg.max_split_size == 64 * MiB
        assert list(cfg.roundup_divisions) == pool.options["roundup_power2_divisions"]
        assert cfg.expandable_segments == 0
    finally:
        _core._torch_unregister(DEVICE)
    # A device with no pool: the code, nothing written.
    cfg = Config()
    assert api.config(DEVICE, ctypes.byref(cfg)) == MP_EINVAL
    assert api.config(-1, ctypes.byref(cfg)) == MP_EINVAL
    assert cfg.gc_threshold == 0.0
