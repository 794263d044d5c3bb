"""Pool.set_size_policy: the rounding, split limit and collection threshold of a live pool
(Note [Size policy at run time] in mempool/_csrc/core/mp_core.c), on sim."""
import warnings

import pytest

import mempool

MiB = 1 << 20


def sim(**options):
    return mempool.Pool(backend="sim", capacity="4GiB", **options)


def current(pool, key):
    return pool.stats()[f"{key}.current"]


def test_a_new_rounding_applies_to_the_next_request_and_old_blocks_keep_their_size():
    pool = sim()
    a = pool.alloc(84 * MiB)
    pool.set_size_policy(roundup_power2_divisions=4)
    b = pool.alloc(84 * MiB)
    assert pool.block_info(a)[0] == 84 * MiB and pool.block_info(b)[0] == 96 * MiB
    assert pool.options["roundup_power2_divisions"] == [4] * 16
    pool.set_size_policy(roundup_power2_divisions="[64:8,>:2]")
    assert pool.options["roundup_power2_divisions"][:7] == [8] * 7
    pool.free(a)
    pool.free(b)
    pool.check_invariants()


@pytest.mark.parametrize("before, after", [(40 * MiB, None), (None, 40 * MiB)])
def test_oversize_counters_uncount_what_they_counted(before, after):
    """A block (and segment) counted as oversize under the split limit of its allocation is
    uncounted at its free whatever the limit is by then, and one that was not is not: the
    counters come back to 0, never below."""
    pool = sim(max_split_size=before)
    ptr = pool.alloc(64 * MiB)
    counted = 1 if before is not None else 0
    assert current(pool, "oversize_allocations") == counted
    assert current(pool, "oversize_segments") == counted
    pool.set_size_policy(max_split_size=after)
    pool.free(ptr)
    assert current(pool, "oversize_allocations") == 0
    pool.empty_cache()
    assert current(pool, "oversize_segments") == 0
    stats = pool.stats()
    assert stats["oversize_allocations.allocated"] == stats["oversize_allocations.freed"]
    assert stats["oversize_segments.allocated"] == stats["oversize_segments.freed"]
    ptr = pool.alloc(64 * MiB)                  # and the new limit counts the next one
    assert current(pool, "oversize_allocations") == (1 if after is not None else 0)
    pool.free(ptr)
    pool.check_invariants()


def test_a_new_split_limit_stops_a_large_cached_block_serving_a_small_request():
    pool = sim()
    pool.free(pool.alloc(200 * MiB))
    ptr = pool.alloc(30 * MiB)                  # split out of the cached 200 MiB
    assert pool.stats()["num_device_alloc"] == 1
    pool.free(ptr)
    pool.set_size_policy(max_split_size="64MiB")
    ptr = pool.alloc(30 * MiB)                  # the 200 MiB block is now never split
    assert pool.stats()["num_device_alloc"] == 2
    assert pool.block_info(ptr)[0] == 30 * MiB
    pool.free(ptr)
    pool.check_invariants()


def test_a_new_collection_threshold_releases_idle_segments_before_growing():
    def grow(threshold):
        pool = sim(limit="1GiB")
        # 700 MiB held once, so that growing back to it passes no high-water mark (Note
        # [Reserved high water]): only the collection threshold can release below.
        held = [pool.alloc(300 * MiB), pool.alloc(400 * MiB)]
        for ptr in held:
            pool.free(ptr)
        pool.empty_cache()
        pool.free(pool.alloc(300 * MiB))        # an idle segment
        frees = pool.stats()["num_device_free"]
        pool.set_size_policy(garbage_collection_threshold=threshold)
        pool.alloc(400 * MiB)                   # past 0.5 GiB with the idle one
        return pool.reserved_bytes(), pool.stats()["num_device_free"] - frees
    assert grow(0.0) == (700 * MiB, 0)
    assert grow(0.5) == (400 * MiB, 1)


def test_an_expandable_pool_ignores_a_split_limit_with_a_warning():
    pool = sim(expandable_segments=True)
    with pytest.warns(mempool.ConfigWarning, match="expandable segments win"):
        pool.set_size_policy(max_split_size="64MiB", garbage_collection_threshold=0.5)
    assert pool.options["max_split_size"] is None
    assert pool.options["garbage_collection_threshold"] == 0.5
    ptr = pool.alloc(100 * MiB)
    assert current(pool, "oversize_allocations") == 0
    pool.free(ptr)


@pytest.mark.parametrize("options, error, words", [
    ({"limit": "1GiB"}, TypeError, "unknown option 'limit'"),
    ({"max_split_size": "1MiB"}, ValueError, "max_split_size"),
    ({"garbage_collection_threshold": float("nan")}, ValueError, "garbage_collection_threshold"),
    ({"roundup_power2_divisions": 3}, ValueError, "roundup_power2_divisions"),
    ({"roundup_power2_divisions": 2, "max_split_size": object()}, ValueError, "max_split_size"),
])
def test_a_refused_change_names_the_option_and_changes_nothing(options, error, words):
    pool = sim(roundup_power2_divisions=4, max_split_size="64MiB")
    before = dict(pool.options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(error, match=words):
            pool.set_size_policy(**options)
    assert pool.options == before
    assert pool.block_info(pool.alloc(84 * MiB))[0] == 96 * MiB   # still the old rounding


def test_options_changed_by_the_caller_are_neither_read_nor_trusted():
    """The options the call leaves out stay as the pool has them: pool.options is the
    caller's dict, and a list put there once crashed the process (written past a 16-entry
    array)."""
    pool = sim(roundup_power2_divisions=4, max_split_size="64MiB")
    pool.options["roundup_power2_divisions"] = list(range(4000))
    pool.options["max_split_size"] = "junk"
    pool.options["expandable_segments"] = True
    pool.set_size_policy(garbage_collection_threshold=0.25)
    assert pool.options["roundup_power2_divisions"] == [4] * 16
    assert pool.options["max_split_size"] == 64 * MiB
    assert pool.options["garbage_collection_threshold"] == 0.25
    assert pool.block_info(pool.alloc(84 * MiB))[0] == 96 * MiB
