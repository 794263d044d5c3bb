"""The pool's contract, written once and run on every upstream, as RMM's ``mr_ref`` tests run
over every memory resource: ``sim``, ``host`` and ``cuda`` (marked ``gpu``: skipped without a
device, selected by ``pytest -m gpu tests``).

What differs between upstreams lives in the small classes below (how to make a stream, wait
for it, write and read a block's bytes, export a Buffer through DLPack), never in the checks.
What only one upstream can show stays with it: exact addresses and stream timing on ``sim``
(test_core_*.py, test_retention.py, ...), injected failures on ``host`` and ``sim``, the
driver's own behaviour and the frameworks on a GPU (tests/gpu/).
"""
import gc
import random

import pytest

import mempool
from _dlpack import capsule_name, dims, managed
from mempool import _core

KiB, MiB = 1 << 10, 1 << 20
ALIGN = 512
SIZES = [4, 511, 512, 513, 4 * KiB, 100 * KiB, MiB - 1, MiB, MiB + 1, 3 * MiB, 10 * MiB - 4,
         10 * MiB, 10 * MiB + 4, 64 * MiB, 257 * MiB]
DL_CPU, DL_CUDA = 1, 2          # DLPack's device types
FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3   # block states in layout()


class Upstream:
    """One upstream as the contract sees it. `readable`: the pool's addresses hold bytes the
    test can write and read back (sim's do not: they are simulated)."""

    name = None
    readable = True
    dl_device = None

    def __init__(self):
        self.pools = []
        self.streams = []

    def pool(self, **options):
        pool = mempool.Pool(backend=self.name, **options)
        self.pools.append(pool)
        return pool

    def stream(self):
        """A new stream argument for alloc/free/record_stream."""
        raise NotImplementedError

    def handle(self, stream):
        """The integer handle the pool stores for `stream` (layout(), block_info())."""
        return stream

    def sync(self, pool):
        """Wait for every stream's queued work."""

    def fill(self, ptr, nbytes, value, stream):
        """Write byte `value` over [ptr, ptr + nbytes), ordered on `stream`."""

    def intact(self, ptr, nbytes, value, stream):
        """Whether [ptr, ptr + nbytes) holds only byte `value` (True when not readable)."""
        return True

    def export(self, buf):
        """A legacy DLPack capsule of `buf`, with no stream synchronisation."""
        return buf.__dlpack__(stream=-1)

    def close(self):
        for pool in self.pools:
            self.sync(pool)
            pool.check_invariants()
        self.pools.clear()
        gc.collect()


class Sim(Upstream):
    name = "sim"
    readable = False
    dl_device = DL_CUDA         # a sim capsule describes the CUDA tensor it stands for

    def stream(self):
        self.streams.append(0x40 + len(self.streams))   # any integer names a sim stream
        return self.streams[-1]

    def sync(self, pool):
        pool.device.complete_all()

    def export(self, buf):
        # sim Buffers refuse __dlpack__ (their addresses are fake); this runs the same export.
        return _core._export_simulated(buf, stream=-1)


class Host(Upstream):
    name = "host"
    dl_device = DL_CPU

    def stream(self):
        self.streams.append(0x40 + len(self.streams))   # host work is synchronous: any int
        return self.streams[-1]

    def fill(self, ptr, nbytes, value, stream):
        import ctypes
        ctypes.memset(ptr, value, nbytes)

    def intact(self, ptr, nbytes, value, stream):
        import ctypes
        return ctypes.string_at(ptr, nbytes).count(value) == nbytes


class Cuda(Upstream):
    name = "cuda"
    dl_device = DL_CUDA

    def __init__(self):
        super().__init__()
        import cupy
        self.cupy = cupy
        cupy.cuda.Device(0).use()

    def pool(self, **options):
        return super().pool(device=0, **options)

    def stream(self):
        self.streams.append(self.cupy.cuda.Stream(non_blocking=True))
        return self.streams[-1]

    def handle(self, stream):
        return stream.ptr

    def sync(self, pool):
        self.cupy.cuda.Device(0).synchronize()

    def _view(self, ptr, nbytes):
        cupy = self.cupy
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, self, 0)
        return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def fill(self, ptr, nbytes, value, stream):
        with stream:
            self._view(ptr, nbytes).fill(value)

    def intact(self, ptr, nbytes, value, stream):
        with stream:
            return int((self._view(ptr, nbytes) != value).sum()) == 0


UPSTREAMS = {"sim": Sim, "host": Host, "cuda": Cuda}


@pytest.fixture(params=["sim", "host", pytest.param("cuda", marks=pytest.mark.gpu)])
def up(request):
    """Each upstream in turn; its pools' invariants are checked after the test."""
    upstream = UPSTREAMS[request.param]()
    yield upstream
    upstream.close()


def spans_overlap(spans):
    spans = sorted(spans)
    return any(end > start for (_, end), (start, _) in zip(spans, spans[1:]))


def check_totals(pool):
    """The figures every pool reports agree with one another."""
    st = pool.stats()
    assert pool.used_bytes() == st["allocated_bytes.all.current"]
    assert pool.reserved_bytes() == st["reserved_bytes.all.current"]
    assert pool.used_bytes() + pool.cached_bytes() <= pool.reserved_bytes()
    for key in ("allocated_bytes.all", "reserved_bytes.all", "allocation.all", "segment.all"):
        assert st[key + ".peak"] >= st[key + ".current"], key
    assert st["allocation.all.current"] == st["allocation.all.allocated"] - st["allocation.all.freed"]
    assert pool.largest_free_block() <= pool.cached_bytes()


# --------------------------------------------------------------------------- alloc and free

def test_every_size_round_trips_aligned_apart_and_counted(up):
    pool = up.pool()
    s = up.stream()
    live = []
    for i, nbytes in enumerate(SIZES):
        ptr = pool.alloc(nbytes, stream=s)
        size, requested, stream = pool.block_info(ptr)
        assert ptr % ALIGN == 0 and size % ALIGN == 0, f"{nbytes} B: block {ptr:#x}+{size}"
        assert size >= nbytes and requested == nbytes and stream == up.handle(s)
        up.fill(ptr, nbytes, i + 1, s)
        live.append((ptr, size, nbytes, i + 1))
        pool.check_invariants()
    assert not spans_overlap([(p, p + size) for p, size, _, _ in live]), "live blocks overlap"
    assert pool.used_bytes() == sum(size for _, size, _, _ in live)
    assert pool.stats()["requested_bytes.all.current"] == sum(SIZES)
    check_totals(pool)
    # Every block still holds its own bytes: no write landed in another block.
    assert all(up.intact(p, n, v, s) for p, _, n, v in live)
    random.Random(0).shuffle(live)
    for ptr, _, _, _ in live:
        pool.free(ptr, stream=s)
        pool.check_invariants()
    assert pool.used_bytes() == 0
    st = pool.stats()
    assert st["allocation.all.allocated"] == st["allocation.all.freed"] == len(SIZES)
    assert st["allocation.all.peak"] == len(SIZES)
    pool.empty_cache()
    up.sync(pool)
    assert pool.reserved_bytes() == 0 and pool.stats()["segment.all.current"] == 0


def test_random_alloc_free_keeps_every_block_intact(up):
    pool = up.pool()
    s = up.stream()
    rng = random.Random(1234)
    live = {}
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 40):
            ptr = rng.choice(sorted(live))
            nbytes, value = live.pop(ptr)
            assert up.intact(ptr, nbytes, value, s), f"step {step}: block {ptr:#x} damaged"
            pool.free(ptr, stream=s)
        else:
            nbytes = rng.choice([rng.randrange(1, 64 * KiB), rng.randrange(64 * KiB, 4 * MiB),
                                 rng.randrange(4 * MiB, 24 * MiB)])
            ptr = pool.alloc(nbytes, stream=s)
            assert ptr not in live
            value = step % 255 + 1
            up.fill(ptr, nbytes, value, s)
            live[ptr] = (nbytes, value)
        if step % 25 == 0:
            pool.check_invariants()
            check_totals(pool)
    for ptr, (nbytes, value) in live.items():
        assert up.intact(ptr, nbytes, value, s)
        pool.free(ptr, stream=s)
    assert pool.used_bytes() == 0


def test_zero_bytes_is_a_distinct_smallest_block(up):
    pool = up.pool()
    ptrs = [pool.alloc(0, stream=up.stream()) for _ in range(3)]
    assert len(set(ptrs)) == 3
    assert all(pool.block_info(p)[:2] == (ALIGN, 0) for p in ptrs)
    for p in ptrs:
        pool.free(p)


@pytest.mark.parametrize("call, error, fragment", [
    (lambda pool, live: pool.alloc(-1), ValueError, "nbytes must be >= 0"),
    (lambda pool, live: pool.alloc(1.5), TypeError, "nbytes must be an integer"),
    (lambda pool, live: pool.alloc(None), TypeError, "nbytes must be an integer"),
    (lambda pool, live: pool.alloc(1 << 64), ValueError, "below 2\\*\\*64"),
    (lambda pool, live: pool.free(live + 512 * MiB), ValueError, "not a live pointer"),
    (lambda pool, live: pool.record_stream(live, "s"), TypeError, "stream must be"),
])
def test_bad_arguments_are_refused_and_change_nothing(up, call, error, fragment):
    pool = up.pool()
    live = pool.alloc(MiB, stream=up.stream())
    before = (pool.stats(), pool.layout(), pool.pinned_streams)
    with pytest.raises(error, match=fragment):
        call(pool, live)
    assert (pool.stats(), pool.layout(), pool.pinned_streams) == before
    pool.free(live)


def test_a_double_free_is_refused(up):
    pool = up.pool()
    s = up.stream()
    ptr = pool.alloc(4 * KiB, stream=s)
    pool.free(ptr, stream=s)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(ptr, stream=s)
    assert pool.stats()["allocation.all.freed"] == 1


def test_peak_and_accumulated_stats_reset(up):
    pool = up.pool()
    s = up.stream()
    big = pool.alloc(8 * MiB, stream=s)
    small = pool.alloc(MiB, stream=s)
    pool.free(big, stream=s)
    st = pool.stats()
    assert st["allocated_bytes.all.peak"] > st["allocated_bytes.all.current"]
    pool.reset_peak_stats()
    st = pool.stats()
    assert st["allocated_bytes.all.peak"] == st["allocated_bytes.all.current"] == pool.used_bytes()
    pool.reset_accumulated_stats()
    st = pool.stats()
    assert st["allocation.all.allocated"] == st["allocation.all.freed"] == 0
    assert st["allocation.all.current"] == 1          # what is live stays counted
    pool.free(small, stream=s)


# --------------------------------------------------------------------------- limit and OOM

def test_the_limit_refuses_and_the_pool_stays_usable(up):
    pool = up.pool(limit=256 * MiB)
    s = up.stream()
    first = pool.alloc(200 * MiB, stream=s)
    up.fill(first, 200 * MiB, 1, s)
    used, reserved, layout = pool.used_bytes(), pool.reserved_bytes(), pool.layout()
    with pytest.raises(mempool.OutOfMemoryError, match="refused by the pool's limit of 256") as info:
        pool.alloc(100 * MiB, stream=s)
    assert isinstance(info.value, MemoryError)
    assert (pool.used_bytes(), pool.reserved_bytes(), pool.layout()) == (used, reserved, layout)
    assert pool.stats()["num_ooms"] == 1
    pool.check_invariants()
    # What fits under the limit still works, and the first block was not disturbed.
    small = pool.alloc(40 * MiB, stream=s)
    up.fill(small, 40 * MiB, 2, s)
    assert up.intact(first, 200 * MiB, 1, s) and up.intact(small, 40 * MiB, 2, s)
    pool.free(first, stream=s)
    again = pool.alloc(100 * MiB, stream=s)          # the request that failed fits now
    assert pool.reserved_bytes() <= 256 * MiB
    pool.free(again, stream=s)
    pool.free(small, stream=s)


def test_set_limit_below_what_is_reserved_keeps_it_and_refuses_growth(up):
    pool = up.pool()
    s = up.stream()
    held = pool.alloc(30 * MiB, stream=s)
    pool.set_limit(16 * MiB)
    assert pool.used_bytes() == 30 * MiB              # nothing is taken back
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(MiB, stream=s)
    pool.set_limit(None)
    pool.free(pool.alloc(MiB, stream=s), stream=s)
    pool.free(held, stream=s)


# --------------------------------------------------------------------------- releasing memory

def test_trim_and_empty_cache_release_idle_segments_only(up):
    pool = up.pool()
    s = up.stream()
    busy = pool.alloc(12 * MiB, stream=s)
    up.fill(busy, 12 * MiB, 7, s)
    busy_reserved = pool.reserved_bytes()
    idle = [pool.alloc(n * MiB, stream=s) for n in (14, 16, 18)]
    for p in idle:
        pool.free(p, stream=s)
    up.sync(pool)
    cached = pool.cached_bytes()
    assert cached >= 48 * MiB
    keep = cached - 10 * MiB                          # releasing one idle segment is enough
    pool.trim(keep=keep)
    trimmed = pool.reserved_bytes()
    assert pool.cached_bytes() <= keep
    assert trimmed >= busy_reserved + 30 * MiB, "trim released more than it had to"
    pool.trim(keep=keep)                              # nothing left to do
    assert pool.reserved_bytes() == trimmed
    pool.empty_cache()
    assert pool.reserved_bytes() == busy_reserved     # the busy segment stays
    assert up.intact(busy, 12 * MiB, 7, s)
    check_totals(pool)
    pool.free(busy, stream=s)
    pool.empty_cache()
    up.sync(pool)
    assert pool.reserved_bytes() == 0 and pool.cached_bytes() == 0


def test_release_threshold_zero_keeps_nothing_idle(up):
    pool = up.pool(release_threshold=0)
    s = up.stream()
    ptr = pool.alloc(24 * MiB, stream=s)
    assert pool.reserved_bytes() >= 24 * MiB
    pool.free(ptr, stream=s)
    up.sync(pool)
    pool.set_release_threshold(0)                     # checked again, the stream now idle
    assert pool.reserved_bytes() == 0


# --------------------------------------------------------------------------- streams

def test_record_stream_then_forget_stream(up):
    pool = up.pool()
    a, b = up.stream(), up.stream()
    ptr = pool.alloc(3 * MiB, stream=a)
    up.fill(ptr, 3 * MiB, 5, a)
    pool.record_stream(ptr, b)
    pool.free(ptr, stream=a)
    assert pool.used_bytes() == 0
    up.sync(pool)
    # Once both streams are done, the block serves its own stream again.
    again = pool.alloc(3 * MiB, stream=a)
    assert pool.block_info(again)[2] == up.handle(a)
    pool.free(again, stream=a)
    other = pool.alloc(MiB, stream=b)
    pool.free(other, stream=b)
    for stream in (a, b):
        pool.forget_stream(stream)
    handles = {up.handle(a), up.handle(b)}
    # Nothing the pool keeps names a forgotten stream, and the pool holds none of them alive.
    on = {seg["stream"] for seg in pool.layout()}
    on |= {blk["stream"] for seg in pool.layout() for blk in seg["blocks"]}
    assert not on & handles and not set(pool.pinned_streams) & handles
    pool.check_invariants()
    fresh = up.stream()
    pool.free(pool.alloc(3 * MiB, stream=fresh), stream=fresh)
    pool.empty_cache()
    up.sync(pool)


def test_a_block_freed_on_another_stream_is_reused_on_it(up):
    pool = up.pool()
    a, b = up.stream(), up.stream()
    ptr = pool.alloc(2 * MiB, stream=a)
    up.fill(ptr, 2 * MiB, 9, a)
    pool.free(ptr, stream=b)                          # used last on b
    up.sync(pool)
    assert pool.used_bytes() == 0
    pool.check_invariants()
    nxt = pool.alloc(2 * MiB, stream=a)
    up.fill(nxt, 2 * MiB, 10, a)
    assert up.intact(nxt, 2 * MiB, 10, a)
    pool.free(nxt, stream=a)


# --------------------------------------------------------------------------- DLPack

def test_dlpack_export_shares_the_block_and_frees_it_once(up):
    pool = up.pool()
    s = up.stream()
    buf = pool.empty((3, 4), "float32", stream=s)
    assert pool.block_info(buf.ptr)[1:] == (48, up.handle(s))
    cap = up.export(buf)
    assert capsule_name(cap) == "dltensor"
    t = managed(cap).contents.dl_tensor
    assert (t.data, t.device.device_type, t.device.device_id) == (buf.ptr, up.dl_device, 0)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)     # kDLFloat
    assert dims(managed(cap)) == ((3, 4), (4, 1))
    freed = pool.stats()["allocation.all.freed"]
    del buf, t
    gc.collect()
    assert pool.used_bytes() > 0, "the capsule holds the block"
    del cap                                           # unconsumed: its destructor frees it
    gc.collect()
    assert pool.stats()["allocation.all.freed"] == freed + 1 and pool.used_bytes() == 0


# --------------------------------------------------------------------------- what pools report

def test_layout_tiles_every_segment_and_the_snapshot_agrees(up):
    pool = up.pool()
    s = up.stream()
    live = [pool.alloc(n, stream=s) for n in (100, 4 * KiB, 700 * KiB, 3 * MiB, 13 * MiB)]
    pool.free(live.pop(1), stream=s)
    layout = pool.layout()
    assert sum(seg["total_size"] for seg in layout) == pool.reserved_bytes()
    seen = []
    for seg in layout:
        assert set(seg) >= {"address", "total_size", "mapped_size", "stream", "is_small",
                            "is_expandable", "is_pinned", "blocks"}
        at = seg["address"]
        for blk in seg["blocks"]:                     # the blocks tile the segment in order
            assert blk["address"] == at and blk["state"] in (FREE, ALLOCATED, PENDING, UNMAPPED)
            at += blk["size"]
            if blk["state"] == ALLOCATED:
                seen.append(blk["address"])
        assert at == seg["address"] + seg["total_size"]
    assert sorted(seen) == sorted(live)
    snap = pool.snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    assert [(g["address"], g["total_size"]) for g in snap["segments"]] == \
        [(seg["address"], seg["total_size"]) for seg in layout]
    for g in snap["segments"]:
        active = [b for b in g["blocks"] if b["state"] == "active_allocated"]
        assert g["allocated_size"] == sum(b["size"] for b in active)
        assert g["segment_type"] in ("small", "large")
    assert sum(g["allocated_size"] for g in snap["segments"]) == pool.used_bytes()
    for p in live:
        pool.free(p, stream=s)


def test_a_free_block_shows_the_size_last_requested_of_it(up):
    """As PyTorch's snapshot: a free block's requested_size is the size last asked of it,
    that of the block freed last when free neighbours merged (PyTorch's test_memory_plots
    finds an allocation's size there once _memory_viz has dropped freed pairs from the
    trace); the layout keeps requested_size 0 for free blocks and gives the size as
    last_requested_size."""
    pool = up.pool()
    s = up.stream()
    a, b, c = (pool.alloc(n, stream=s) for n in (1000, 3000, 5000))
    pool.free(a, stream=s)
    pool.free(b, stream=s)                            # merges with a's block: b's size stays

    def block_at(blocks, address):
        for blk in blocks:
            if blk["address"] <= address < blk["address"] + blk["size"]:
                return blk
        raise AssertionError(f"no block covers {address:#x}")

    layout_blocks = [blk for seg in pool.layout() for blk in seg["blocks"]]
    freed = block_at(layout_blocks, b)
    assert freed["state"] == FREE and freed["requested_size"] == 0
    assert freed["last_requested_size"] == 3000
    live = block_at(layout_blocks, c)
    assert live["requested_size"] == live["last_requested_size"] == 5000
    snap_blocks = [blk for seg in pool.snapshot()["segments"] for blk in seg["blocks"]]
    assert block_at(snap_blocks, b)["requested_size"] == 3000
    assert block_at(snap_blocks, b)["state"] == "inactive"
    pool.free(c, stream=s)


# --------------------------------------------------------------------------- expandable segments

def test_an_expandable_segment_grows_in_place_and_gives_pages_back(up):
    pool = up.pool(expandable_segments=True)
    s = up.stream()
    sizes = [3 * MiB, 5 * MiB + 512, 7 * MiB - 4, 2 * MiB, 11 * MiB + 4 * KiB, 33 * MiB,
             MiB + 512, 9 * MiB]
    blocks = []
    for i, nbytes in enumerate(sizes):
        ptr = pool.alloc(nbytes, stream=s)
        up.fill(ptr, nbytes, 10 + i, s)
        blocks.append((ptr, nbytes, 10 + i))
    pool.check_invariants()
    assert pool.stats()["segment.large_pool.current"] == 1, "the segment did not grow in place"
    [seg] = [g for g in pool.layout() if not g["is_small"]]
    assert seg["is_expandable"] and seg["mapped_size"] >= sum(sizes)
    # Some blocks straddle a page boundary (2 MiB pages: sim's, host's and an H200's).
    assert any(p // (2 * MiB) != (p + n - 1) // (2 * MiB) for p, n, _ in blocks)
    assert all(up.intact(p, n, v, s) for p, n, v in blocks)
    # Free every other block and give their pages back: the neighbours sharing pages with
    # them stay mapped and intact.
    mapped = seg["mapped_size"]
    for ptr, _, _ in blocks[1::2]:
        pool.free(ptr, stream=s)
    pool.empty_cache()
    up.sync(pool)
    pool.check_invariants()
    assert pool.stats()["mapped_bytes.current"] < mapped
    kept = blocks[0::2]
    assert all(up.intact(p, n, v, s) for p, n, v in kept)
    for i, nbytes in enumerate(sizes[1::2]):          # grow again, into released pages
        ptr = pool.alloc(nbytes, stream=s)
        up.fill(ptr, nbytes, 50 + i, s)
        kept.append((ptr, nbytes, 50 + i))
    assert pool.stats()["segment.large_pool.current"] == 1
    assert all(up.intact(p, n, v, s) for p, n, v in kept)
    for ptr, _, _ in kept:
        pool.free(ptr, stream=s)
    pool.empty_cache()
    up.sync(pool)
    assert pool.reserved_bytes() == 0 and pool.stats()["mapped_bytes.current"] == 0


def test_small_blocks_grow_one_small_expandable_segment(up):
    pool = up.pool(expandable_segments=True)
    s = up.stream()
    blocks = []
    for i in range(48):         # ~9.6 MiB of 200 KiB blocks: several pages of one segment
        nbytes = 200 * KiB + 4 * i
        ptr = pool.alloc(nbytes, stream=s)
        up.fill(ptr, nbytes, i + 1, s)
        blocks.append((ptr, nbytes, i + 1))
    assert pool.stats()["segment.small_pool.current"] == 1
    assert all(up.intact(p, n, v, s) for p, n, v in blocks)
    for ptr, _, _ in blocks:
        pool.free(ptr, stream=s)


def test_an_expandable_pool_under_a_limit_refuses_and_recovers(up):
    pool = up.pool(expandable_segments=True, limit=64 * MiB)
    s = up.stream()
    a = pool.alloc(40 * MiB, stream=s)
    up.fill(a, 40 * MiB, 9, s)
    with pytest.raises(mempool.OutOfMemoryError, match="limit"):
        pool.alloc(40 * MiB, stream=s)
    pool.check_invariants()
    assert up.intact(a, 40 * MiB, 9, s)
    pool.free(a, stream=s)
    b = pool.alloc(60 * MiB, stream=s)                # the freed pages serve a larger block
    up.fill(b, 60 * MiB, 10, s)
    assert up.intact(b, 60 * MiB, 10, s) and pool.reserved_bytes() <= 64 * MiB
    pool.free(b, stream=s)
