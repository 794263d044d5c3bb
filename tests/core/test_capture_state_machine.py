"""The core's state machines (tests/_machines.py)
with CUDA graph captures (docs/architecture.md, Note [Graph capture]).

A capture starts and ends at any step, on a stream the machine also allocates, frees, records
and queues work on, and the pool is told of it (as PyTorch's glue tells it, so that calls on
every stream are covered, as the driver's global capture mode requires). Besides the
machines' own checks, after every step: the simulated device saw no call a capture forbids
(capture_violations), and while one runs no segment was freed, no page unmapped, no stream
synchronized; empty_cache and trim then release nothing.
"""
import hypothesis.strategies as st
from hypothesis.stateful import invariant, rule

from mempool import _core
from _machines import SETTINGS, ExpandableMachine, PoolMachine

CAPTURABLE = (5, 9)   # the machines' streams other than the legacy one, which cannot capture
FORBIDDEN = ("frees", "unmaps", "syncs")


class CaptureRules:
    """Rules and checks added to a pool machine."""
    capturing = None

    @rule(stream=st.sampled_from(CAPTURABLE))
    def begin_capture(self, stream):
        if self.capturing is not None:
            return
        _core._capture_begin(self.pool)
        self.dev.begin_capture(stream)
        self.capturing = stream
        self.at_begin = self._forbidden()

    @rule()
    def end_capture(self):
        if self.capturing is None:
            return
        self.dev.end_capture(self.capturing)   # raises when a call broke the capture
        self.capturing = None
        _core._capture_end(self.pool)

    def _forbidden(self):
        c = self.dev.counters()
        return {k: c[k] for k in FORBIDDEN}

    def _keeps_everything(self, release):
        before = self.pool.reserved_bytes()
        release()
        assert self.pool.reserved_bytes() == before

    @rule()
    def empty_cache(self):
        if self.capturing is None:
            super().empty_cache()
        else:
            self._keeps_everything(self.pool.empty_cache)

    @rule(keep=st.integers(0, 64 << 20))
    def trim(self, keep):
        if self.capturing is None:
            super().trim(keep)
        else:
            self._keeps_everything(lambda: self.pool.trim(keep))

    @rule(stream=st.sampled_from((5, 9)), destroy=st.booleans())
    def forget(self, stream, destroy):
        """forget_stream synchronizes the stream: refused while a capture is under way (the
        pool was told of it, so whichever stream it knows), with nothing changed; a stream
        the pool never saw is a no-op."""
        if self.capturing is None:
            return super().forget(stream, destroy)
        before = (self.pool.reserved_bytes(), self.pool.used_bytes(), len(self.pool.layout()))
        try:
            self.pool.forget_stream(stream)
        except RuntimeError as exc:
            assert "capture" in str(exc)
        assert (self.pool.reserved_bytes(), self.pool.used_bytes(),
                len(self.pool.layout())) == before

    @invariant()
    def no_forbidden_call(self):
        if hasattr(self, "dev"):
            assert self.dev.capture_violations == 0
            if self.capturing is not None:
                assert self._forbidden() == self.at_begin

    def teardown(self):
        if hasattr(self, "dev"):
            self.end_capture()
        super().teardown()


class CaptureDefault(CaptureRules, PoolMachine):
    options = {}


class CaptureReleaseEagerly(CaptureRules, PoolMachine):
    options = {"release_threshold": 0, "garbage_collection_threshold": 0.5}


class CaptureLimited(CaptureRules, PoolMachine):
    options = {"limit": 128 << 20, "max_split_size": 32 << 20}


class CaptureExpandable(CaptureRules, ExpandableMachine):
    options = {"release_threshold": 0}


TestCaptureDefault = CaptureDefault.TestCase
TestCaptureReleaseEagerly = CaptureReleaseEagerly.TestCase
TestCaptureLimited = CaptureLimited.TestCase
TestCaptureExpandable = CaptureExpandable.TestCase
for case in (TestCaptureDefault, TestCaptureReleaseEagerly, TestCaptureLimited,
             TestCaptureExpandable):
    case.settings = SETTINGS
del case   # not a test of its own
