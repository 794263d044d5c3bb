"""Note [Hot blocks]: a block freed with nothing to wait for is parked on its stream and
handed back to that stream's next request of its size; anything else folds it into the free
lists first, as the plain free would have."""
import pytest

from _support import MiB

S, T = 11, 22
KiB = 1 << 10


def three_blocks(pool, stream=S):
    """Blocks a, b, c of 4 KiB at the front of one segment, c next to its free tail."""
    a, b, c = (pool.alloc(4 * KiB, stream=stream) for _ in range(3))
    assert b == a + 4 * KiB and c == b + 4 * KiB
    return a, b, c


def test_the_block_freed_last_serves_its_streams_next_request_of_its_size(sim):
    pool = sim()
    a, b, c = three_blocks(pool)
    pool.free(a)        # parked, then folded in when c is parked: a hole before b
    pool.free(c)        # parked: the plain free would merge it into the segment's tail
    # Best fit over the plain lists would give the hole a; the hot block c comes first.
    assert pool.alloc(4 * KiB, stream=S) == c
    pool.check_invariants()
    assert pool.alloc(4 * KiB, stream=S) == a
    pool.check_invariants()


def test_any_other_request_folds_the_hot_block_in_first(sim):
    pool = sim()
    a, b, c = three_blocks(pool)
    pool.free(c)
    d = pool.alloc(8 * KiB, stream=S)   # another size: c merged back into the tail first
    assert d == c
    pool.check_invariants()


def test_a_free_completing_later_on_the_stream_takes_precedence(sim):
    pool = sim()
    a, b, c = three_blocks(pool)
    pool.record_stream(a, T)
    pool.device.launch(T)
    pool.free(a)        # waits for T
    pool.free(c)        # parked hot
    pool.device.complete(T)
    # a's free completes in this call: the stream's lists changed after c was parked, so
    # the request takes the plain path (best fit: the hole a).
    assert pool.alloc(4 * KiB, stream=S) == a
    pool.check_invariants()


def test_another_stream_sees_hot_blocks_as_free_memory(sim):
    pool = sim()
    x = pool.alloc(6 * MiB, stream=S)             # the front of a 20 MiB segment
    pool.free(x)                                  # parked on S, next to the free tail
    y = pool.alloc(4 * MiB, stream=T)             # taken across streams, as after a plain free:
    assert y == x                                 # the front of the merged segment
    assert pool.stats()["num_cross_stream_reuse"] == 1
    pool.free(y)
    pool.check_invariants()


def test_growing_folds_hot_blocks_in_first(sim):
    pool = sim(capacity=20 * MiB, cross_stream_reuse=False)
    x = pool.alloc(6 * MiB, stream=S)             # the device's only segment
    pool.free(x)                                  # parked on S: the segment would look busy
    y = pool.alloc(6 * MiB, stream=T)             # needs that segment released and made again
    assert y
    pool.free(y)
    pool.check_invariants()


def test_a_hot_block_freed_again_is_a_double_free(sim):
    pool = sim()
    a = pool.alloc(4 * KiB, stream=S)
    pool.free(a)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(a)
    pool.check_invariants()
    assert pool.alloc(4 * KiB, stream=S) == a
    pool.free(a)


def test_a_hot_block_is_not_live_to_record_stream_or_block_info(sim):
    pool = sim()
    a = pool.alloc(4 * KiB, stream=S)
    pool.free(a)                                  # parked, its map entry kept
    with pytest.raises(ValueError, match="already freed"):
        pool.record_stream(a, T)
    with pytest.raises(ValueError, match="not a live block"):
        pool.block_info(a)
    assert pool.used_bytes() == 0
    pool.check_invariants()


@pytest.mark.parametrize("release", ["empty_cache", "trim", "stats", "snapshot"])
def test_views_and_releases_see_the_plain_layout(sim, release):
    pool = sim()
    a = pool.alloc(4 * KiB, stream=S)
    pool.free(a)
    getattr(pool, release)()
    if release in ("empty_cache", "trim"):
        assert pool.reserved_bytes() == 0
    else:
        assert pool.stats()["inactive_split.all.current"] == 0   # one whole free segment
    pool.check_invariants()


def test_pools_whose_free_path_keeps_books_park_nothing(sim):
    pool = sim(release_threshold=0)
    a, b, c = three_blocks(pool)
    pool.free(a)
    pool.free(c)
    assert pool.alloc(4 * KiB, stream=S) == a      # plain best fit: the hole
    pool.check_invariants()


def test_expandable_pools_park_hot_blocks_and_fold_them_in_before_growing(sim):
    """Expandable pools park hot blocks too (their free path keeps no books of its own);
    a growth folds them in first, so a parked block still merges with the free edge it
    would extend instead of leaving more pages to map."""
    pool = sim(expandable_segments=True, granularity=64 * KiB)
    a, b, c = three_blocks(pool)
    pool.free(a)
    pool.free(c)
    assert pool.alloc(4 * KiB, stream=S) == c       # the hot block, as without expandable
    pool.check_invariants()
    pool.free(c)                                    # parked again, next to the free tail
    maps = pool.device.counters()["maps"]
    big = pool.alloc(60 * KiB, stream=S)            # needs c's bytes and the tail's
    assert big == c
    assert pool.device.counters()["maps"] == maps + 1
    assert pool.reserved_bytes() == 128 * KiB       # one page more, not more than that
    pool.check_invariants()


def test_hot_blocks_across_many_streams_and_sizes_stay_consistent(sim):
    import random
    pool = sim()
    rng = random.Random(7)
    live = []
    for step in range(3000):
        if live and rng.random() < 0.5:
            ptr, stream = live.pop(rng.randrange(len(live)))
            pool.free(ptr, stream=rng.choice([None, stream]))
        else:
            stream = rng.choice([S, T, 33])
            live.append((pool.alloc(rng.choice([512, 4 * KiB, 4 * KiB, 64 * KiB, 3 * MiB]),
                                    stream=stream), stream))
        if step % 97 == 0:
            pool.check_invariants()
    for ptr, _ in live:
        pool.free(ptr)
    pool.check_invariants()
    assert pool.used_bytes() == 0


# Note [Hot address]: the Pool keeps the int object of the address it handed out or was
# given last; a value is never confused with another.

def test_a_hot_block_comes_back_as_the_same_int_object(sim):
    pool = sim()
    a = pool.alloc(512)
    pool.free(a)
    b = pool.alloc(512)
    assert b == a and b is a
    pool.free(b)
    pool.check_invariants()


def test_an_equal_int_of_another_object_frees_the_same_block(sim):
    pool = sim()
    a = pool.alloc(512)
    other = int(str(a))          # equal, but a different object
    assert other is not a
    pool.free(other)
    assert pool.used_bytes() == 0
    # free was given `other` last: the next hand-out of that address is that object.
    assert pool.alloc(512) is other
    with pytest.raises(ValueError, match="already freed"):
        pool.free(a)
        pool.free(a)
    pool.check_invariants()


def test_addresses_stay_right_when_blocks_take_turns(sim):
    pool = sim()
    a, b = pool.alloc(4 * KiB, stream=S), pool.alloc(4 * KiB, stream=T)
    for _ in range(3):
        pool.free(a)
        pool.free(b)
        a2, b2 = pool.alloc(4 * KiB, stream=S), pool.alloc(4 * KiB, stream=T)
        assert (a2, b2) == (a, b)
        a, b = a2, b2
    pool.free(a)
    pool.free(b)
    assert pool.used_bytes() == 0
    pool.check_invariants()


def test_the_remembered_address_does_not_make_a_bad_free_pass(sim):
    pool = sim()
    a = pool.alloc(512)
    pool.free(a)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(a)             # the remembered object, freed twice
    with pytest.raises(ValueError, match="inside a live block"):
        b = pool.alloc(4 * KiB)
        pool.free(b + 512)
    with pytest.raises(TypeError):
        pool.free(float(b))
    pool.free(b)
    assert pool.used_bytes() == 0
    pool.check_invariants()
