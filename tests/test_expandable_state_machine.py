"""A hypothesis state machine over expandable segments on the simulated device.

Rules allocate, free (on the block's stream or another), record streams, queue and complete
work, inject failures (the next N upstream calls, or a map that fails part-way), and release
(empty_cache, trim) across several streams and many sizes. After every step:

- check_invariants(): blocks tile every range, free neighbours of one stream are merged,
  unmapped blocks are page-aligned, free lists and every counter add up;
- the pages add up: reserved bytes == mapped bytes in the layout == the device's mapped pages
  == the device's used bytes, and the device saw no double map or unmap;
- no two live blocks overlap, and no block is handed to a stream while work of another
  stream that used its bytes may still be pending, unless the new stream is ordered after
  that work (device.ordered);
- no queued, unfinished work touches an unmapped page: pages go only after the streams that
  used them were synchronized.
"""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mempool

MiB = 1 << 20
STREAMS = (0, 5, 9)
SIZES = st.one_of(st.integers(0, 4096), st.integers(4097, 1 << 20),
                  st.integers((1 << 20) + 1, 24 << 20))
UNMAPPED = 3


class ExpandableMachine(RuleBasedStateMachine):
    options = {}
    capacity = 160 * MiB

    @initialize()
    def make_pool(self):
        self.pool = mempool.Pool(backend="sim", capacity=self.capacity, expandable_segments=True,
                                 **self.options)
        self.dev = self.pool.device
        self.live = {}        # ptr -> (nbytes, stream, streams recorded)
        self.work = []        # (stream, seq, lo, hi): queued work that touched these bytes

    def _pending(self):
        self.work = [w for w in self.work if self.dev.stream_info(w[0])["completed"] < w[1]]
        return self.work

    @rule(nbytes=SIZES, stream=st.sampled_from(STREAMS))
    def alloc(self, nbytes, stream):
        try:
            ptr = self.pool.alloc(nbytes, stream=stream)
        except mempool.OutOfMemoryError:
            return
        size = self.pool.block_info(ptr)[0]
        assert size >= max(nbytes, 1)
        lo, hi = ptr, ptr + size
        for q, (qn, _, _) in self.live.items():
            assert hi <= q or q + qn <= lo, f"block {ptr:#x} overlaps live block {q:#x}"
        for other, seq, wlo, whi in self._pending():
            if wlo < hi and lo < whi and other != stream:
                assert self.dev.ordered(stream, other, seq), (
                    f"{ptr:#x} handed to stream {stream} while stream {other} may still use it")
        self.live[ptr] = (size, stream, set())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def use(self, data):
        """Queue work that touches a live block, on its stream or a recorded one."""
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        size, stream, recorded = self.live[ptr]
        on = data.draw(st.sampled_from(sorted({stream} | recorded)))
        seq = self.dev.launch(on)
        self.work.append((on, seq, ptr, ptr + size))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), other=st.sampled_from(STREAMS))
    def record(self, data, other):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.record_stream(ptr, other)
        self.live[ptr][2].add(other)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), on=st.sampled_from((None,) + STREAMS))
    def free(self, data, on):
        """Free on the block's stream (None), or on a recorded stream that used it last: the
        pool then waits for the block's own stream and the other recorded ones."""
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        _, stream, recorded = self.live.pop(ptr)
        if on is not None and on != stream and on not in recorded:
            on = None          # freeing on a stream that never used it is not a valid program
        self.pool.free(ptr, stream=on)

    @rule(stream=st.sampled_from(STREAMS))
    def complete(self, stream):
        self.dev.complete(stream)

    @rule(n=st.integers(1, 3))
    def fail_next(self, n):
        self.dev.fail_next(n)

    @rule(pages=st.integers(0, 6))
    def fail_map_after(self, pages):
        self.dev.fail_map_after(pages)

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()
        assert self._whole_free_pages() == 0

    @rule(keep=st.integers(0, 48 * MiB))
    def trim(self, keep):
        self.pool.trim(keep)
        if self.pool.cached_bytes() > keep:
            assert self._whole_free_pages() == 0 or self._pinned()

    def _pinned(self):
        return self.options.get("initial_pool_size", 0) > 0

    def _page(self):
        return self.pool.options["granularity"] or 2 * MiB

    def _whole_free_pages(self):
        """Whole pages in runs of free blocks, past any pinned prefix: releasable now."""
        g, n = self._page(), 0
        pin = -(-self.options.get("initial_pool_size", 0) // g) * g
        for seg in self.pool.layout():
            start = seg["address"] + (pin if seg["is_pinned"] else 0)
            run = None
            for b in seg["blocks"] + [{"state": None}]:
                if b["state"] == 0:
                    run = [run[0] if run else b["address"], b["address"] + b["size"]]
                    continue
                if run:
                    lo, hi = max(-(-run[0] // g) * g, start), run[1] // g * g
                    n += max(0, hi - lo) // g
                run = None
        return n

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        pool, dev = self.pool, self.dev
        pool.check_invariants()
        assert pool.used_bytes() == sum(n for n, _, _ in self.live.values())
        layout = pool.layout()
        mapped = sum(b["size"] for s in layout for b in s["blocks"] if b["state"] != UNMAPPED)
        counters = dev.counters()
        assert mapped == pool.reserved_bytes() == counters["mapped_bytes"] == dev.used_bytes
        assert mapped == pool.stats()["mapped_bytes.current"]
        assert counters["errors"] == 0
        limit = pool.options["limit"]
        if limit is not None and not self._pinned():
            assert pool.reserved_bytes() <= limit
        for stream, seq, lo, hi in self._pending():
            for s in layout:
                for b in s["blocks"]:
                    if b["state"] == UNMAPPED and b["address"] < hi and lo < b["address"] + b["size"]:
                        raise AssertionError(
                            f"[{b['address']:#x}, +{b['size']:#x}) unmapped while stream {stream} "
                            f"still has work {seq} on [{lo:#x}, {hi:#x})")

    def teardown(self):
        if hasattr(self, "pool"):
            for ptr in list(self.live):
                self.pool.free(ptr)
            self.dev.complete_all()
            self.pool.empty_cache()
            self.pool.check_invariants()
            g = self._page()
            pinned = -(-self.options.get("initial_pool_size", 0) // g) * g
            assert self.pool.reserved_bytes() == pinned
            assert self.dev.counters()["errors"] == 0


SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class Expandable(ExpandableMachine):
    options = {}


class SmallPages(ExpandableMachine):
    options = {"granularity": 64 << 10}


class LimitedAndCollected(ExpandableMachine):
    options = {"limit": 96 * MiB, "garbage_collection_threshold": 0.5,
               "roundup_power2_divisions": 4}


class ReleaseEagerly(ExpandableMachine):
    options = {"release_threshold": 0, "cross_stream_reuse": False}


class Pinned(ExpandableMachine):
    options = {"initial_pool_size": 9 * MiB, "granularity": 1 << 20}


TestExpandable = Expandable.TestCase
TestSmallPages = SmallPages.TestCase
TestLimitedAndCollected = LimitedAndCollected.TestCase
TestReleaseEagerly = ReleaseEagerly.TestCase
TestPinned = Pinned.TestCase
for case in (TestExpandable, TestSmallPages, TestLimitedAndCollected, TestReleaseEagerly,
             TestPinned):
    case.settings = SETTINGS
