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
from hypothesis.stateful import invariant, rule

from test_core_state_machine import PoolMachine

MiB = 1 << 20
UNMAPPED = 3


class ExpandableMachine(PoolMachine):
    """The core's model (tests/test_core_state_machine.py) with expandable segments on, a
    smaller device, map failures part-way, and the page checks above."""
    capacity = 160 * MiB

    def pool_options(self):
        return dict(self.options, expandable_segments=True)

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
        super().consistent()
        pool, dev = self.pool, self.dev
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

    def kept_after_empty_cache(self):
        g = self._page()
        return -(-self.options.get("initial_pool_size", 0) // g) * g   # pinned pages stay


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
