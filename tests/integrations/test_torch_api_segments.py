"""What the PyTorch glue is told of segments, and where a pool's segments may come from,
through the C table of mp_torch.h on `sim`, with ctypes playing the glue as in
tests/integrations/test_torch_api_table.py: the segment observer (Note [Segment observer]), the release
observer told before segments go upstream (Note [Release observer]), a MemPool's own
allocator as a segment source (Note [Custom segment sources]) and no-split pools (Note
[No split])."""
import ctypes
import gc
import threading

import pytest

import mempool
from mempool import _core
from test_torch_api_table import (DEVICE, F, MP_EINVAL, MP_OK, SEGMENT_ALLOC, SEGMENT_FREE,
                                  SEGMENT_MAP, SEGMENT_UNMAP, MiB, Observer, ReleaseObserver,
                                  Source, i32, sz, u, vp)
from test_torch_api_table import api, routed  # noqa: F401  (fixtures)


CALLBACKS = []


@pytest.fixture
def observed(api):
    """The segment observer set to a recorder (as the glue sets its own at install), and
    unset afterwards: it is process-wide."""
    events = []

    def record(ctx, pool, action, ptr, nbytes, stream):
        events.append((pool, action, ptr, nbytes))

    callback = Observer(record)
    # Kept for the life of the process: a pool's thread that read the observer just before
    # it was unset may still call it.
    CALLBACKS.append(callback)
    api.set_segment_observer(callback, None)
    yield events
    api.set_segment_observer(Observer(), None)


def test_the_observer_sees_every_segment_event_and_its_pool(api, routed, observed):
    address = _core._torch_pool_address(DEVICE)
    assert api.pool_device(address) == DEVICE
    out = u()
    assert api.alloc(DEVICE, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    segment = routed.layout()[0]
    assert observed == [(address, SEGMENT_ALLOC, segment["address"], segment["total_size"])]
    api.free(DEVICE, out.value)
    assert api.empty_cache(DEVICE) == MP_OK
    assert observed[1:] == [(address, SEGMENT_FREE, segment["address"],
                             segment["total_size"])]
    # A pool of no device (a CuPy pool beside PyTorch's, say) is told too; the glue drops
    # its events because no device routes to it.
    other = mempool.Pool(backend="sim", capacity="1GiB")
    other.free(other.alloc(MiB))
    assert len(observed) == 3 and observed[2][1] == SEGMENT_ALLOC
    assert api.pool_device(observed[2][0]) == -1
    assert api.pool_device(None) == -1


def test_the_observer_sees_expandable_maps_and_unmaps(api, observed):
    pool = mempool.Pool(backend="sim", capacity="1GiB", device=DEVICE,
                        expandable_segments=True)
    _core._torch_register(DEVICE, pool)
    try:
        out = u()
        assert api.alloc(DEVICE, 5 * MiB, 0, ctypes.byref(out)) == MP_OK
        maps = [e for e in observed if e[1] == SEGMENT_MAP]
        assert maps and sum(e[3] for e in maps) == pool.reserved_bytes()
        assert all(e[1] == SEGMENT_MAP for e in observed)   # no segment_alloc: as PyTorch's
        api.free(DEVICE, out.value)
        assert api.empty_cache(DEVICE) == MP_OK
        unmaps = [e for e in observed if e[1] == SEGMENT_UNMAP]
        assert sum(e[3] for e in unmaps) == sum(e[3] for e in maps)
        assert pool.reserved_bytes() == 0
    finally:
        pool.empty_cache()
        _core._torch_unregister(DEVICE)


def test_a_pool_destroyed_with_cached_segments_tells_the_observer_they_went(api, routed,
                                                                            observed):
    """Note [Segment events at destroy]: the segments a pool still caches when it is destroyed
    (a MemPool's or a graph's pool, released after its last block) go with a segment_free
    each, as a release would tell it; PyTorch's trace trackers (NCCL's registration) and
    memory history would otherwise keep them for ever."""
    alloc, free, empty_cache, release = pool_fns(api)
    src = FakeSegments()
    handle, out = vp(), u()
    assert api.custom_pool_create(DEVICE, ctypes.byref(src.source), ctypes.byref(handle)) == MP_OK
    assert alloc(handle, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    assert free(handle, out.value, 0, 0) == MP_OK
    (segment,) = src.live.items()
    assert [e[1:] for e in observed] == [(SEGMENT_ALLOC,) + segment]
    release(handle)
    assert src.live == {}                                  # given back to the allocator
    assert [e[1:] for e in observed[1:]] == [(SEGMENT_FREE,) + segment]
    assert observed[1][0] == observed[0][0]                # told as the same pool's


def test_an_expandable_pool_destroyed_unmaps_each_mapped_run_for_the_observer(api, observed):
    gc.collect()          # pools of earlier tests are gone before this one's events count
    pool = mempool.Pool(backend="sim", capacity="1GiB", expandable_segments=True)
    blocks = [pool.alloc(n) for n in (5 * MiB, 3 * MiB, 64 << 10)]
    for b in blocks[:2]:
        pool.free(b)
    maps = [e for e in observed if e[1] == SEGMENT_MAP]
    assert maps
    # Only this pool's events: a pool another test left to the garbage collector may be
    # destroyed while this one runs, and tells the same observer.
    ours = maps[0][0]
    mapped = sum(e[3] for e in maps if e[0] == ours)
    assert mapped == pool.reserved_bytes() > 0
    pool.free(blocks[2])
    del pool, blocks
    gc.collect()
    mine = [e for e in observed if e[0] == ours]
    unmaps = [e for e in mine if e[1] == SEGMENT_UNMAP]
    assert sum(e[3] for e in unmaps) == mapped             # every mapped byte, once
    assert not [e for e in mine if e[1] in (SEGMENT_ALLOC, SEGMENT_FREE)]


class FakeSegments:
    """A segment source as the glue makes of a MemPool's own allocator: addresses it hands
    out (512-byte aligned unless told otherwise), what it was asked and given back."""

    def __init__(self, misalign=0, refuse=False):
        self.next, self.misalign, self.refuse = 1 << 45, misalign, refuse
        self.live, self.allocs, self.frees, self.releases = {}, 0, [], 0
        self._alloc = Source._fields_[1][1](self.alloc)   # kept alive with the source
        self._free = Source._fields_[2][1](self.free)
        self._release = Source._fields_[3][1](self.release)
        self.source = Source(None, self._alloc, self._free, self._release)

    def alloc(self, ctx, nbytes, stream, out):
        if self.refuse:
            return 1                                   # MP_ENOMEM
        self.allocs += 1
        out[0] = self.next + self.misalign
        self.live[out[0]] = nbytes
        self.next += nbytes + (1 << 30)
        return MP_OK

    def free(self, ctx, ptr, nbytes, stream):
        assert self.live.pop(ptr) == nbytes
        self.frees.append(ptr)

    def release(self, ctx):
        self.releases += 1


def pool_fns(api):
    """pool_alloc, pool_free, pool_empty_cache and pool_release of the table."""
    return (F(i32, vp, sz, u, ctypes.POINTER(u))(api.pool_fn_0),
            F(i32, vp, u, u, i32)(api.pool_fn_1), F(i32, vp)(api.pool_fn_8),
            F(None, vp)(api.pool_fn_14))


@pytest.fixture
def release_timeline(api):
    """One timeline of what the segment observer, the release observer and a custom segment
    source's free are told, in order; both observers are process-wide and unset afterwards.
    The release observer also asks the pool it is told of for its used bytes, from another
    thread: that finishes only if the pool's lock is not held (a held lock would block the
    other thread, not this test)."""
    timeline = []
    used_bytes = F(sz, vp)(api.pool_fn_9)

    def segment(ctx, pool, action, ptr, nbytes, stream):
        timeline.append(("event", action, ptr))

    def release(ctx, pool):
        asked = threading.Thread(target=used_bytes, args=(pool,), daemon=True)
        asked.start()
        asked.join(timeout=10)
        timeline.append(("release", "unlocked" if not asked.is_alive() else "LOCKED"))

    callbacks = (Observer(segment), ReleaseObserver(release))
    CALLBACKS.extend(callbacks)   # kept for the life of the process, as `observed`'s
    api.set_segment_observer(callbacks[0], None)
    api.set_release_observer(callbacks[1], None)
    yield timeline
    api.set_release_observer(ReleaseObserver(), None)
    api.set_segment_observer(Observer(), None)


def test_the_release_observer_is_told_before_the_segments_go_upstream(api, routed,
                                                                      release_timeline):
    """Note [Release observer]: PyTorch hands its trace trackers a segment_free before its
    cudaFree (NCCL's registration hook deregisters the memory there). The glue can tell its
    trackers only outside the pool's lock, so the pool calls the release observer, unlocked,
    after the segment observer heard of the segments and before the upstream frees them:
    from empty_cache, and from a pool's destroy for the segments it still caches."""
    alloc, free, empty_cache, release = pool_fns(api)
    src = FakeSegments()
    src.frees = Timeline(release_timeline)
    handle, out = vp(), u()
    assert api.custom_pool_create(DEVICE, ctypes.byref(src.source), ctypes.byref(handle)) == MP_OK
    assert alloc(handle, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    (first,) = src.live
    assert free(handle, out.value, 0, 0) == MP_OK
    assert release_timeline == [("event", SEGMENT_ALLOC, first)]   # no release yet
    assert empty_cache(handle) == MP_OK
    assert release_timeline[1:] == [("event", SEGMENT_FREE, first), ("release", "unlocked"),
                                    ("free", first)]
    assert alloc(handle, 5 * MiB, 0, ctypes.byref(out)) == MP_OK
    (second,) = src.live
    assert free(handle, out.value, 0, 0) == MP_OK
    del release_timeline[:]
    release(handle)                                        # destroyed with it cached
    assert release_timeline == [("event", SEGMENT_FREE, second), ("release", "unlocked"),
                                ("free", second)]


def test_a_release_the_allocation_path_makes_is_told_first_too(api, release_timeline):
    """A release the pool makes on its own (here past its release threshold, on a free)
    goes through the same path: the observer is told before the upstream free."""
    pool = mempool.Pool(backend="sim", capacity="1GiB", release_threshold=0)
    pool.free(pool.alloc(3 * MiB))
    actions = [e[0] if e[0] != "event" else e[1] for e in release_timeline]
    assert actions == [SEGMENT_ALLOC, SEGMENT_FREE, "release"], release_timeline
    assert release_timeline[-1] == ("release", "unlocked")


class Timeline(list):
    """A FakeSegments' frees that also go into a shared timeline as ("free", ptr)."""

    def __init__(self, timeline):
        super().__init__()
        self.timeline = timeline

    def append(self, ptr):
        super().append(ptr)
        self.timeline.append(("free", ptr))


def test_a_custom_segment_source_is_cached_and_given_back_once(api, routed):
    """Note [Custom segment sources]: a MemPool with its own allocator caches that allocator's
    segments as PyTorch's allocator does. A freed block serves the next request without a new
    segment; the allocator's free is called by empty_cache and when the pool goes, and the
    source is released once, after its last segment."""
    alloc, free, empty_cache, release = pool_fns(api)
    src = FakeSegments()
    handle, out = vp(), u()
    assert api.custom_pool_create(DEVICE, ctypes.byref(src.source), ctypes.byref(handle)) == MP_OK
    assert alloc(handle, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    first = out.value
    assert src.allocs == 1 and first in src.live
    assert free(handle, first, 0, 0) == MP_OK
    assert alloc(handle, 3 * MiB, 0, ctypes.byref(out)) == MP_OK
    assert (out.value, src.allocs, src.frees) == (first, 1, [])     # cached, not asked again
    assert alloc(handle, 64 * MiB, 0, ctypes.byref(out)) == MP_OK     # a segment of its own
    big = out.value
    assert src.allocs == 2
    assert free(handle, big, 0, 0) == MP_OK
    assert empty_cache(handle) == MP_OK                               # the idle one goes back
    assert list(src.live) == [first] and src.releases == 0
    assert free(handle, first, 0, 0) == MP_OK
    assert list(src.live) == [first]                                  # cached, free
    release(handle)   # as the glue does once the MemPool is gone and its last block freed
    assert src.live == {} and src.frees[-1] == first and src.releases == 1


def test_a_no_split_pool_hands_out_whole_blocks(api, routed):
    """Note [No split]: MemPool(no_split=True). Each request takes a whole free block or a
    whole new segment of the usual size, so every block starts a segment of its own; a freed
    block serves a smaller request whole. Without it, the same requests share segments."""
    alloc, free, empty_cache, release = pool_fns(api)
    info = F(i32, vp, u, ctypes.POINTER(sz), ctypes.POINTER(sz), ctypes.POINTER(u))(api.pool_fn_4)

    def run(no_split):
        src, handle = FakeSegments(), vp()
        assert api.custom_pool_create(DEVICE, ctypes.byref(src.source),
                                      ctypes.byref(handle)) == MP_OK
        if no_split:
            assert api.pool_set_no_split(handle) == MP_OK
        ptrs, blocks = [], []
        for n in (1000, 1000, 3 * MiB):
            out = u()
            assert alloc(handle, n, 0, ctypes.byref(out)) == MP_OK
            ptrs.append(out.value)
        for p in ptrs:
            nbytes, requested, stream = sz(), sz(), u()
            assert info(handle, p, ctypes.byref(nbytes), ctypes.byref(requested),
                        ctypes.byref(stream)) == MP_OK
            blocks.append((nbytes.value, requested.value))
        assert free(handle, ptrs[2], 0, 0) == MP_OK
        out = u()
        assert alloc(handle, 2 * MiB, 0, ctypes.byref(out)) == MP_OK   # from the freed block
        reused = out.value == ptrs[2]
        segments = src.allocs
        for p in (out.value, ptrs[0], ptrs[1]):
            assert free(handle, p, 0, 0) == MP_OK
        release(handle)
        assert src.live == {}
        return blocks, segments, reused

    assert run(no_split=True) == ([(2 * MiB, 1000), (2 * MiB, 1000), (20 * MiB, 3 * MiB)], 3, True)
    assert run(no_split=False) == ([(1024, 1000), (1024, 1000), (3 * MiB, 3 * MiB)], 2, True)


def test_no_split_is_refused_on_an_expandable_pool(api):
    pool = mempool.Pool(backend="sim", capacity="1GiB", device=DEVICE, expandable_segments=True)
    _core._torch_register(DEVICE, pool)
    try:
        address = vp(_core._torch_pool_address(DEVICE))
        assert api.pool_set_no_split(address) == MP_EINVAL
        pool.free(pool.alloc(1000))                 # nothing changed: still split
        a, b = pool.alloc(1000), pool.alloc(1000)
        assert abs(a - b) == 1024
        pool.free(a)
        pool.free(b)
    finally:
        _core._torch_unregister(DEVICE)


def test_a_custom_source_that_fails_or_misaligns_fails_the_request(api, routed):
    alloc, free, empty_cache, release = pool_fns(api)
    out, handle = u(), vp()
    full = FakeSegments(refuse=True)
    assert api.custom_pool_create(DEVICE, ctypes.byref(full.source), ctypes.byref(handle)) == MP_OK
    assert alloc(handle, MiB, 0, ctypes.byref(out)) == 1              # MP_ENOMEM
    release(handle)
    assert full.releases == 1
    odd = FakeSegments(misalign=256)                                  # the core needs 512
    assert api.custom_pool_create(DEVICE, ctypes.byref(odd.source), ctypes.byref(handle)) == MP_OK
    assert alloc(handle, MiB, 0, ctypes.byref(out)) == 8              # MP_EUPSTREAM
    assert odd.allocs == 1 and odd.live == {} and len(odd.frees) == 1   # given back at once
    release(handle)
    # Refused arguments change nothing, and the caller keeps its source.
    keep = FakeSegments()
    assert api.custom_pool_create(DEVICE, None, ctypes.byref(handle)) == MP_EINVAL
    assert api.custom_pool_create(DEVICE + 1, ctypes.byref(keep.source),
                                  ctypes.byref(handle)) == MP_EINVAL     # no pool there
    no_alloc = Source(None, Source._fields_[1][1](), keep._free, keep._release)
    assert api.custom_pool_create(DEVICE, ctypes.byref(no_alloc), ctypes.byref(handle)) == MP_EINVAL
    assert keep.releases == 0
