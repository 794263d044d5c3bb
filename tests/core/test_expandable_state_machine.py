"""A hypothesis state machine over expandable segments on the simulated device.

Rules allocate, free (on the block's stream or another), record streams, queue and complete
work, inject failures (the next N upstream calls, or a map that fails part-way), and release
(empty_cache, trim) across several streams and many sizes. After every step:

- check_invariants(): blocks tile every range, free neighbours of one stream are merged,
  unmapped blocks are page-aligned, free lists and every counter add up;
- the pages add up: reserved bytes == mapped bytes in the layout == the device's mapped pages
  == the device's used bytes, the device's physical allocations are the layout's maps, and
  it saw no double map or unmap nor one that cut an allocation;
- no two live blocks overlap, and no block is handed to a stream while work of another
  stream that used its bytes may still be pending, unless the new stream is ordered after
  that work (device.ordered);
- no queued, unfinished work touches an unmapped page: pages go only after the streams that
  used them were synchronized.
"""
from hypothesis import HealthCheck, settings

from _machines import ExpandableMachine

MiB = 1 << 20


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


class SmallMaps(ExpandableMachine):
    # growths cut into allocations of two pages, released only whole (Note [Growth extents])
    options = {"max_map_size": 4 * MiB, "release_threshold": 8 * MiB}


class EdgeGrowth(ExpandableMachine):
    # growths at a range's end map at least 16 MiB as one allocation (Note [Edge growth]),
    # with small maps and a threshold so that releases meet those allocations too
    options = {"min_map_size": 16 * MiB, "max_map_size": 8 * MiB, "release_threshold": 8 * MiB}


class Pinned(ExpandableMachine):
    options = {"initial_pool_size": 9 * MiB, "granularity": 1 << 20}


TestExpandable = Expandable.TestCase
TestSmallPages = SmallPages.TestCase
TestLimitedAndCollected = LimitedAndCollected.TestCase
TestReleaseEagerly = ReleaseEagerly.TestCase
TestPinned = Pinned.TestCase
TestSmallMaps = SmallMaps.TestCase
TestEdgeGrowth = EdgeGrowth.TestCase
for case in (TestExpandable, TestSmallPages, TestLimitedAndCollected, TestReleaseEagerly,
             TestPinned, TestSmallMaps, TestEdgeGrowth):
    case.settings = SETTINGS
del case   # the loop variable: not a test of its own (pytest would run that case twice)
