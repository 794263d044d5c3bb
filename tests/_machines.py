"""The state machines the stateful tests run (hypothesis): a pool on the simulated device
driven by random rules, its invariants checked after every step. The test files subclass them
with options; the graph-capture machine adds its rules to both."""
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import mempool
from _support import releasable_maps

STREAMS = (0, 5, 9)
SIZES = st.one_of(st.integers(0, 4096), st.integers(4097, 1 << 20),
                  st.integers((1 << 20) + 1, 64 << 20))


class PoolMachine(RuleBasedStateMachine):
    """The shared model; subclasses set `options` (and may add rules and checks)."""
    options = {}
    capacity = 512 << 20

    def pool_options(self):
        return dict(self.options)

    @initialize()
    def make_pool(self):
        self.pool = mempool.Pool(backend="sim", capacity=self.capacity, **self.pool_options())
        self.dev = self.pool.device
        self.live = {}        # ptr -> (nbytes, stream, streams recorded)
        self.work = []        # (stream, seq, lo, hi): work that touched these bytes

    def _pending(self):
        out = []
        for stream, seq, lo, hi in self.work:
            if self.dev.stream_info(stream)["completed"] < seq:
                out.append((stream, seq, lo, hi))
        self.work = out
        return out

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

    @rule(n=st.integers(1, 3))
    def fail_events(self, n):
        """Event records fail: frees and releases fall back to synchronizing the streams."""
        self.dev.fail_events(n)

    @rule(stream=st.sampled_from(STREAMS[1:]), destroy=st.booleans())
    def forget(self, stream, destroy):
        """forget_stream, then maybe destroy it: its handle may name a new stream later."""
        self.pool.forget_stream(stream)
        assert self.dev.stream_info(stream)["completed"] == self.dev.stream_info(stream)["submitted"]
        for ptr, (size, owner, recorded) in list(self.live.items()):
            self.live[ptr] = (size, 0 if owner == stream else owner, recorded - {stream})
            assert self.pool.block_info(ptr)[2] == self.live[ptr][1]
        assert all(s["stream"] != stream for s in self.pool.layout())
        if destroy:
            # Its work is complete (asserted above); the handle may name a new stream, whose
            # counters start afresh, so the model forgets the old stream's work too.
            self.work = [w for w in self.work if w[0] != stream]
            self.dev.destroy_stream(stream)

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()

    @rule(keep=st.integers(0, 64 << 20))
    def trim(self, keep):
        self.pool.trim(keep)
        if self.pool.cached_bytes() > keep:
            # then nothing releasable is left: no segment is wholly free
            for seg in self.pool.layout():
                assert any(b["state"] != 0 for b in seg["blocks"]), seg

    @invariant()
    def consistent(self):
        if hasattr(self, "pool"):
            self.pool.check_invariants()
            assert self.pool.used_bytes() == sum(n for n, _, _ in self.live.values())

    def teardown(self):
        if hasattr(self, "pool"):
            for ptr in list(self.live):
                self.pool.free(ptr)
            self.dev.complete_all()
            self.pool.empty_cache()
            self.pool.check_invariants()
            assert self.pool.reserved_bytes() == self.kept_after_empty_cache()
            assert self.dev.counters()["errors"] == 0

    def kept_after_empty_cache(self):
        return 0


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])




MiB = 1 << 20
UNMAPPED = 3


class ExpandableMachine(PoolMachine):
    """The core's model (PoolMachine above) with expandable segments on, a
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
        assert self._releasable_maps() == 0

    @rule(keep=st.integers(0, 48 * MiB))
    def trim(self, keep):
        self.pool.trim(keep)
        if self.pool.cached_bytes() > keep:
            assert self._releasable_maps() == 0 or self._pinned()

    def _pinned(self):
        return self.options.get("initial_pool_size", 0) > 0

    def _page(self):
        return self.pool.options["granularity"] or 2 * MiB

    def _releasable_maps(self):
        """Physical allocations in runs of free blocks, past any pinned prefix: releasable
        now."""
        g = self._page()
        return releasable_maps(self.pool, -(-self.options.get("initial_pool_size", 0) // g) * g)

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
        # the device's physical allocations are the pool's (Note [Growth extents])
        assert counters["live_maps"] == sum(len(s["maps"]) for s in layout)
        assert counters["split_unmaps"] == 0
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
