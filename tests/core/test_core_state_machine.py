"""A hypothesis state machine over the core on the simulated device.

After every step: check_invariants() (no gap or overlap, segments covered, free neighbours of
one stream merged, free lists and counters consistent), no two live blocks overlap, and no
block is ever handed to a stream while work of another stream that used its bytes may still
be pending, unless the new stream is ordered after that work (device.ordered).
"""
import hypothesis.strategies as st
from hypothesis.stateful import rule

from _machines import SETTINGS, PoolMachine


class DefaultPool(PoolMachine):
    options = {}


class NoCrossStreamReuse(PoolMachine):
    options = {"cross_stream_reuse": False}


class RoundedAndLimited(PoolMachine):
    options = {"roundup_power2_divisions": 4, "limit": 256 << 20, "max_split_size": 32 << 20}


class ReleaseEagerly(PoolMachine):
    options = {"release_threshold": 0, "garbage_collection_threshold": 0.5}


class RoundedSegmentsUnderALimit(PoolMachine):
    """Note [Segment rounding]: whole 32 MiB segments while no limit is set, plain ones
    while one is, and the two kinds side by side as the limit comes and goes."""
    options = {"segment_rounding": 32 << 20}

    @rule(limited=st.booleans())
    def set_limit(self, limited):
        self.pool.set_limit(200 << 20 if limited else None)


class RoundedSegmentsBelowMaxSplit(PoolMachine):
    """Note [Segment rounding] with max_split_size: segments rounded while they stay below
    it, plain ones from it up (and small ones of one unit)."""
    options = {"segment_rounding": 32 << 20, "max_split_size": 64 << 20}


TestDefaultPool = DefaultPool.TestCase
TestNoCrossStreamReuse = NoCrossStreamReuse.TestCase
TestRoundedAndLimited = RoundedAndLimited.TestCase
TestReleaseEagerly = ReleaseEagerly.TestCase
TestRoundedSegmentsUnderALimit = RoundedSegmentsUnderALimit.TestCase
TestRoundedSegmentsBelowMaxSplit = RoundedSegmentsBelowMaxSplit.TestCase
for case in (TestDefaultPool, TestNoCrossStreamReuse, TestRoundedAndLimited, TestReleaseEagerly):
    case.settings = SETTINGS
del case   # the loop variable: not a test of its own (pytest would run that case twice)
