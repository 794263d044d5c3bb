"""Note [Events outside the lock]: the pool creates events only with its lock dropped and,
in a Pool method, the GIL let go, so that a driver call that waits on a driver-wide lock
never does so holding either.

The simulated device holds event creations on request (``device.hold_event_creates``): the
call waits inside the device until ``release_held`` or its timeout. While it waits, the main
thread must run Python (the GIL is free) and allocate and free on the same pool (its lock is
free). The three places that draw on the event cache are each driven to an empty cache:
cross-stream reuse (alloc), a free with recorded streams, and the release of a segment whose
blocks other streams own. Each must end as it did when events were made under the lock: the
same block reused, the free pending on its event, the segment freed after an event wait,
never the fallbacks (a fresh segment, a host sync).
"""
import os
import shutil
import subprocess
import textwrap
import threading

import pytest

import mempool
from mempool import _core
from test_blocking_upstream import WAIT, finish, in_thread, wait_until_held

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CC = os.environ.get("CC", "cc")


def creates(pool):
    return pool.device.counters()["event_creates"]


def test_cross_stream_reuse_creates_its_event_without_the_gil_or_the_pool_lock():
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = pool.alloc(4 * MiB, stream=1)      # a large block: the small lists stay empty
    dev.launch(1)                          # the owner has work queued: stream 2 must wait
    pool.free(a)
    dev.hold_event_creates(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.alloc(4 * MiB, stream=2))
    assert wait_until_held(dev), "the allocating thread kept the GIL through the creation"
    # The pool lock is free too: a small block of a new segment, no event needed.
    small = pool.alloc(512, stream=3)
    pool.free(small)
    ptr = finish(thread, out, dev)
    assert ptr == a, "the cross-stream block was not reused after the event was made"
    stats = pool.stats()
    assert stats["num_cross_stream_reuse"] == 1 and stats["num_event_waits"] == 1
    assert stats["num_device_alloc"] == 2          # a's segment and the small one, no other
    assert dev.ordered(2, 1, 1)                    # stream 2 waits for stream 1's work
    assert dev.counters()["hold_timeouts"] == 0 and creates(pool) == 1
    pool.free(ptr)
    pool.check_invariants()


def test_a_free_with_recorded_streams_creates_its_events_without_the_gil_or_the_pool_lock():
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = pool.alloc(4096, stream=1)
    pool.record_stream(a, 7)
    pool.record_stream(a, 8)
    dev.launch(7)
    dev.launch(8)
    syncs = dev.counters()["syncs"]
    dev.hold_event_creates(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.free(a))
    assert wait_until_held(dev), "the freeing thread kept the GIL through the creation"
    other = pool.alloc(4096, stream=1)             # the rest of a's segment, on its stream
    pool.free(other)
    finish(thread, out, dev)
    assert dev.counters()["hold_timeouts"] == 0
    assert dev.counters()["syncs"] == syncs, "the free fell back to a host sync"
    assert creates(pool) == 2                      # one event per recorded stream
    stats = pool.stats()
    assert stats["active.all.current"] == 1        # a waits for streams 7 and 8
    dev.complete(7)
    dev.complete(8)
    assert pool.alloc(4096, stream=1) == a         # its events completed: a is free again
    pool.check_invariants()


def test_a_release_that_waits_on_another_owner_creates_its_event_without_the_gil_or_lock():
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = pool.alloc(4 * MiB, stream=1)
    pool.free(a, stream=2)                 # a's segment stays stream 1's; stream 2 owns a
    # The one event made so far is kept by a free that waits on stream 8: the cache is empty.
    b = pool.alloc(4096, stream=3)
    pool.record_stream(b, 8)
    dev.launch(8)
    pool.free(b)
    made, syncs, waits = creates(pool), dev.counters()["syncs"], dev.counters()["waits"]
    assert made == 1
    dev.hold_event_creates(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.trim(0))
    assert wait_until_held(dev), "the releasing thread kept the GIL through the creation"
    other = pool.alloc(4096, stream=3)             # the rest of b's segment, on its stream
    pool.free(other)
    finish(thread, out, dev)
    counters = dev.counters()
    # The one missing, and as many again as the pool had: a rising need drops the lock
    # a few times, not once per event.
    assert counters["hold_timeouts"] == 0 and creates(pool) == 2 * made + 1
    assert counters["frees"] == 1                  # a's segment went back ...
    assert counters["waits"] == waits + 1          # ... after stream 1 waited on stream 2
    assert counters["syncs"] == syncs, "the release fell back to a host sync"
    dev.complete(8)
    pool.check_invariants()


def deferred_free(pool, stream, use):
    """A block of `stream`, used on `use`, freed while `use` captures a graph: the free
    records no event until the capture is over (Note [Graph capture]); `use` then has work
    queued, so the free stays pending once it records."""
    dev = pool.device
    a = pool.alloc(4096, stream=stream)
    pool.record_stream(a, use)
    assert dev.begin_capture(use) is None
    pool.free(a)
    dev.end_capture(use)
    dev.launch(use)
    return a


def test_a_free_deferred_by_a_capture_creates_its_event_without_the_gil_or_the_pool_lock():
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = deferred_free(pool, 1, 7)
    assert creates(pool) == 0 and pool.stats()["active.all.current"] == 1
    syncs = dev.counters()["syncs"]
    dev.hold_event_creates(1, timeout=WAIT)
    # The next allocation records the deferred free's event first.
    thread, out = in_thread(lambda: pool.alloc(4 * MiB, stream=2))
    assert wait_until_held(dev), "the allocating thread kept the GIL through the creation"
    other = pool.alloc(4096, stream=1)             # the rest of a's segment, on its stream
    pool.free(other)
    pool.free(finish(thread, out, dev))
    # Two made: the main thread's allocation recorded the deferred free meanwhile, with an
    # event of its own; the held one went to the cache.
    assert dev.counters()["hold_timeouts"] == 0 and creates(pool) == 2
    assert dev.counters()["syncs"] == syncs, "the deferred free fell back to a host sync"
    assert pool.stats()["active.all.current"] == 1   # a waits for stream 7's work
    dev.complete(7)
    assert pool.alloc(4096, stream=1) == a
    assert dev.capture_violations == 0
    pool.check_invariants()


def test_the_end_of_a_capture_records_deferred_frees_without_the_gil_or_the_pool_lock():
    """_capture_end (the pool told of a capture it cannot see, as PyTorch's glue does)
    records the frees deferred meanwhile: their events are made with the GIL let go."""
    pool = mempool.Pool(backend="sim", cross_stream_reuse=False)
    dev = pool.device
    a = pool.alloc(4096, stream=1)
    pool.record_stream(a, 7)
    dev.launch(7)
    _core._capture_begin(pool)
    pool.free(a)                                   # deferred: no event during a capture
    assert creates(pool) == 0
    dev.hold_event_creates(1, timeout=WAIT)
    thread, out = in_thread(lambda: _core._capture_end(pool))
    assert wait_until_held(dev), "_capture_end kept the GIL through the creation"
    other = pool.alloc(4096, stream=1)
    pool.free(other)
    finish(thread, out, dev)
    assert dev.counters()["hold_timeouts"] == 0 and dev.counters()["syncs"] == 0
    assert pool.stats()["active.all.current"] == 1   # a waits for stream 7's work
    dev.complete(7)
    assert pool.alloc(4096, stream=1) == a
    pool.check_invariants()


def test_forget_stream_finds_its_stream_again_after_the_lock_was_dropped():
    """forget_stream hands its stream's pending frees over, which may make an event with
    the lock dropped; another thread forgets another stream meanwhile and moves the first
    one's place in the pool's table. The first must remove its own stream, not the one
    now at its old place."""
    pool = mempool.Pool(backend="sim", cross_stream_reuse=False)   # no event before the hold
    dev = pool.device
    keep = pool.alloc(4096, stream=0)              # the table: 0, 3, 1, 7, 5
    pool.free(pool.alloc(4096, stream=3))
    deferred_free(pool, 1, 7)
    pool.record_stream(keep, 5)                    # no allocation: a's free stays deferred
    assert pool.stats()["num_streams"] == 5 and creates(pool) == 0
    dev.hold_event_creates(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.forget_stream(5))
    assert wait_until_held(dev), "forget_stream kept the GIL through the creation"
    pool.forget_stream(3)                          # moves stream 5 to 3's place
    finish(thread, out, dev)
    assert dev.counters()["hold_timeouts"] == 0
    pool.check_invariants()
    assert pool.stats()["num_streams"] == 3        # 0, 1 and 7
    dev.complete(7)
    ptr = pool.alloc(4096, stream=7)               # stream 7 kept its state
    pool.free(ptr)
    pool.free(keep)
    pool.check_invariants()


def test_an_expandable_range_is_reserved_without_the_gil_or_the_pool_lock():
    """The address space of an expandable segment's range is reserved (cuMemAddressReserve)
    with the lock dropped and the GIL let go, as events are made; a thread that gave the
    stream a range meanwhile wins, and the reservation made in vain goes back."""
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    dev = pool.device
    dev.hold_va_reserves(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.alloc(4 * MiB, stream=1))
    assert wait_until_held(dev), "the allocating thread kept the GIL through the reservation"
    other = pool.alloc(MiB, stream=2)              # another stream: its own range
    pool.free(other)
    mine = pool.alloc(4 * MiB, stream=1)           # stream 1's range, made meanwhile
    ptr = finish(thread, out, dev)
    assert dev.counters()["hold_timeouts"] == 0 and dev.counters()["errors"] == 0
    stats = pool.stats()
    assert stats["segment.all.current"] == 2       # one range per stream: the held one went
    assert stats["va_reserved_bytes.current"] == 2 * pool.capacity
    assert ptr != mine and pool.block_info(ptr)[2] == 1
    pool.free(ptr)
    pool.free(mine)
    pool.check_invariants()
    pool.empty_cache()
    pool.check_invariants()


def test_a_growth_that_waited_for_its_range_uses_a_block_freed_meanwhile():
    """While the reservation waits, another thread gives the stream a range and frees a
    block there large enough: the waiting growth takes that block (it searches again after
    the lock drop) instead of planning a map of nothing beside it."""
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    dev = pool.device
    dev.hold_va_reserves(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.alloc(4 * MiB, stream=1))
    assert wait_until_held(dev)
    mine = pool.alloc(4 * MiB, stream=1)
    pool.free(mine)
    maps = dev.counters()["maps"]
    ptr = finish(thread, out, dev)
    assert ptr == mine and dev.counters()["maps"] == maps   # reused, nothing mapped
    assert dev.counters()["errors"] == 0 and dev.counters()["hold_timeouts"] == 0
    pool.free(ptr)
    pool.check_invariants()


def test_a_steady_cross_stream_loop_creates_no_event_after_its_first_round():
    """The cache keeps what was made: a loop that reuses blocks across streams, frees with
    recorded streams and releases segments of several owners makes its events once."""
    pool = mempool.Pool(backend="sim", release_threshold=0)
    dev = pool.device

    def one_round():
        a = pool.alloc(MiB, stream=1)
        dev.launch(1)
        pool.free(a)
        b = pool.alloc(MiB, stream=2)              # stream 1's block, after an event wait
        pool.record_stream(b, 7)
        dev.launch(7)
        pool.free(b, stream=3)                     # pending on streams 7 and 2
        dev.complete_all()

    one_round()
    made, stats = creates(pool), pool.stats()
    assert made >= 1
    for _ in range(50):
        one_round()
    after = pool.stats()
    assert creates(pool) == made, "events were made again after the first round"
    assert after["num_cross_stream_reuse"] - stats["num_cross_stream_reuse"] == 50
    assert after["num_device_free"] - stats["num_device_free"] == 50   # released each round
    assert dev.counters()["live_events"] == made
    pool.check_invariants()


def test_threads_sharing_streams_keep_every_event_accounted_for():
    """Several threads draw on one cache and stock it, each with its lock drops: no event
    is lost or handed out twice (check_invariants counts them), and none is made once
    the cache has seen the threads' peak."""
    pool = mempool.Pool(backend="sim", release_threshold=4 * MiB)
    dev = pool.device
    errors = []

    def work(k):
        try:
            for i in range(300):
                s = 1 + (k + i) % 4
                ptr = pool.alloc((1 + i % 3) * 256 * 1024, stream=s)
                if i % 5 == 0:
                    pool.record_stream(ptr, 11 + k)
                    dev.launch(11 + k)
                pool.free(ptr, stream=1 + (s % 4))
                if i % 7 == 0:
                    dev.complete_all()
        except BaseException as exc:   # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    dev.complete_all()
    pool.check_invariants()
    pool.empty_cache()
    assert pool.reserved_bytes() == 0
    assert dev.counters()["live_events"] == creates(pool)   # the pool destroys none early
    pool.check_invariants()


@pytest.mark.parametrize("args, message", [
    ((-1,), "n must be >= 0"),
    ((1.5,), "n must be an integer"),
    ((1, 0), "timeout must be a number of seconds"),
    ((1, True), "timeout must be a number of seconds"),
])
def test_hold_event_creates_refuses_bad_arguments(args, message):
    pool = mempool.Pool(backend="sim")
    with pytest.raises((TypeError, ValueError), match=message):
        pool.device.hold_event_creates(*args)
    a = pool.alloc(MiB, stream=1)
    pool.free(a)
    assert pool.alloc(MiB, stream=2) == a   # an event was made: nothing was held
    assert pool.device.counters()["hold_timeouts"] == 0


@pytest.mark.skipif(shutil.which(CC) is None, reason="needs a C compiler")
@pytest.mark.parametrize("debug", [0, 1])
def test_the_debug_build_knows_which_thread_holds_a_pool_lock(tmp_path, debug):
    """mp_up_event_create asserts !mp_lock_held_by_me(&p->lock) in the debug build: the
    answer must be exact for the calling thread (another thread holding the lock is no
    breach), and the release build keeps no holder (the lock stays one word)."""
    src = tmp_path / "held.c"
    src.write_text(textwrap.dedent("""
        #include <stdio.h>
        #include "mp_lock.h"
        static mp_lock lock;
        static int other_saw = -1;
        static void *other(void *arg) { (void)arg; other_saw = mp_lock_held_by_me(&lock); return NULL; }
        int main(void) {
            mp_lock_init(&lock);
            int before = mp_lock_held_by_me(&lock);
            mp_lock_acquire(&lock);
            int during = mp_lock_held_by_me(&lock);
            pthread_t t;
            pthread_create(&t, NULL, other, NULL);
            pthread_join(t, NULL);
            mp_lock_release(&lock);
            printf("%d %d %d %d %zu\\n", before, during, other_saw, mp_lock_held_by_me(&lock),
                   sizeof(mp_lock));
            return 0;
        }
    """))
    exe = tmp_path / "held"
    flags = [f"-DMP_DEBUG={debug}"] if debug else []
    subprocess.run([CC, "-std=gnu11", "-Wall", "-Werror", "-Wno-unused-function", "-pthread",
                    *flags, "-I", os.path.join(ROOT, "mempool", "_csrc", "core"),
                    "-I", os.path.join(ROOT, "mempool", "_csrc", "common"), str(src),
                    "-o", str(exe)], check=True)
    before, during, other, after, size = subprocess.run(
        [str(exe)], capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert (before, other, after) == ("0", "0", "0")
    assert during == ("1" if debug else "0")
    if not debug:
        assert size == "4"
