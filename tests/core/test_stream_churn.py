"""Note [Forgotten streams]: a stream the pool was told to forget costs nothing afterwards.

A stream-per-request program follows the documented rule (``forget_stream`` before the stream
is destroyed) thousands of times: the pool must then keep no state for those streams, give
back the address ranges it reserved for them, and never call the driver with their handles.
And a free that cannot get an event to order itself after another stream synchronizes that
stream without the pool lock (Note [Lock order]).
"""
import threading
import time

import pytest

import mempool

MiB = 1 << 20
STREAMS = range(1001, 3001)   # 2,000 streams, as many as the reproduction


def churn(pool, streams, nbytes=4096, destroy=True):
    for s in streams:
        pool.free(pool.alloc(nbytes, stream=s))
        pool.forget_stream(s)
        if destroy:
            pool.device.destroy_stream(s)


@pytest.mark.parametrize("cross_stream_reuse", [False, True])
def test_forgotten_streams_give_back_their_ranges_and_state(cross_stream_reuse):
    pool = mempool.Pool(backend="sim", expandable_segments=True,
                        cross_stream_reuse=cross_stream_reuse)
    pool.free(pool.alloc(4096, stream=0))   # the legacy stream's own range
    base = pool.stats()
    churn(pool, STREAMS)
    st = pool.stats()
    # Each forgotten stream's range went with it: before, 2,001 ranges (156 TiB) stayed.
    assert st["va_reserved_bytes.current"] == base["va_reserved_bytes.current"]
    assert st["segment.all.current"] == base["segment.all.current"]
    assert st["num_streams"] == 1                           # the legacy stream alone
    assert st["mapped_bytes.current"] <= base["mapped_bytes.current"]
    pool.empty_cache()
    assert pool.stats()["va_reserved_bytes.current"] == base["va_reserved_bytes.current"]
    assert pool.device.counters()["errors"] == 0
    pool.check_invariants()


def test_forgotten_streams_state_is_bounded_without_expandable_segments():
    pool = mempool.Pool(backend="sim")
    churn(pool, STREAMS)
    st = pool.stats()
    assert st["num_streams"] == 1
    assert pool.device.counters()["streams"] <= 2           # the sim's table is bounded too
    assert st["segment.all.current"] == 1                   # one small segment, reused
    pool.check_invariants()


def test_a_range_with_live_blocks_outlives_its_stream_and_goes_once_empty():
    pool = mempool.Pool(backend="sim", expandable_segments=True, cross_stream_reuse=False)
    pool.free(pool.alloc(4096, stream=0))
    base = pool.stats()["va_reserved_bytes.current"]
    keep = pool.alloc(4096, stream=5)
    pool.forget_stream(5)
    st = pool.stats()
    assert st["va_reserved_bytes.current"] == 2 * base       # the live block holds it
    assert pool.block_info(keep)[2] == 0                     # handed to the legacy stream
    assert {seg["stream"] for seg in pool.layout()} == {0}
    pool.free(keep)
    pool.check_invariants()
    pool.empty_cache()                                       # nothing mapped: the range goes
    assert pool.stats()["va_reserved_bytes.current"] == base
    assert pool.stats()["segment.all.current"] == 1
    pool.check_invariants()


def test_the_legacy_stream_takes_over_a_range_when_it_has_none():
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    keep = pool.alloc(4096, stream=5)
    pool.forget_stream(5)
    # The legacy stream had no small range: it grows on in stream 5's, next to the block.
    a = pool.alloc(4096, stream=0)
    assert a == keep + 4096
    assert pool.stats()["segment.all.current"] == 1
    pool.free(a)
    pool.free(keep)
    pool.check_invariants()


def test_pending_frees_waiting_on_a_forgotten_stream_complete():
    pool = mempool.Pool(backend="sim")
    a = pool.alloc(4096, stream=1)
    pool.record_stream(a, 7)
    pool.device.launch(7)
    pool.free(a)                                             # pending on stream 7's event
    assert pool.stats()["active.all.current"] == 1
    pool.forget_stream(7)                                    # synchronizes 7: the free is done
    assert pool.stats()["active.all.current"] == 0
    assert pool.alloc(4096, stream=1) == a
    pool.check_invariants()


def test_forget_stream_from_another_thread_during_a_growth():
    """A stream forgotten while another thread grows on it (the pool lock dropped for the
    map): its struct stays until that thread is done, and what it got goes to the legacy
    stream."""
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    pool.device.hold_allocs(1, timeout=5.0)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("ptr", pool.alloc(MiB, stream=5)))
    t.start()
    deadline = time.monotonic() + 5
    while pool.device.held < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.device.held == 1
    pool.forget_stream(5)
    pool.device.release_held()
    t.join(5)
    assert not t.is_alive()
    pool.check_invariants()
    pool.forget_stream(9)                                    # reaps the forgotten struct
    assert pool.block_info(out["ptr"])[2] == 0
    pool.free(out["ptr"])
    assert pool.stats()["num_streams"] == 1
    pool.check_invariants()


def test_a_free_without_an_event_synchronizes_without_the_pool_lock():
    """Note [Lock order]: no event for a recorded stream, so the free waits for that stream
    by a sync, held here inside the device; another thread allocates from the same pool
    meanwhile, which needs the pool lock."""
    pool = mempool.Pool(backend="sim")
    dev = pool.device
    a = pool.alloc(4096, stream=1)
    pool.record_stream(a, 7)
    dev.launch(7)
    dev.fail_events(1)
    dev.hold_syncs(1, timeout=5.0)
    t = threading.Thread(target=pool.free, args=(a,))
    t.start()
    deadline = time.monotonic() + 5
    while dev.held < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert dev.held == 1, "the freeing thread kept the GIL through the sync"
    got = {}
    other = threading.Thread(target=lambda: got.setdefault("ptr", pool.alloc(4096, stream=2)))
    other.start()
    other.join(2)
    alive = other.is_alive()
    dev.release_held()
    t.join(5)
    other.join(5)
    assert not alive, "the sync held the pool lock: another thread could not allocate"
    assert dev.stream_info(7)["completed"] == 1              # stream 7 was synchronized
    assert pool.stats()["active.all.current"] == 1           # only the other thread's block
    assert pool.alloc(4096, stream=1) == a                   # the free completed
    pool.check_invariants()


@pytest.mark.parametrize("expandable", [False, True], ids=["default", "expandable"])
def test_forgetting_streams_while_other_threads_use_them_stays_consistent(expandable):
    """Forgetting a stream that another thread still allocates on breaks the contract, but
    must not break the pool: the forgotten struct waits for the operations under way."""
    import random
    pool = mempool.Pool(backend="sim", expandable_segments=expandable, granularity=64 << 10,
                        capacity=1 << 30)
    stop = time.monotonic() + 1.5
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        held = []
        try:
            while time.monotonic() < stop:
                s = rng.randint(1, 6)
                held.append(pool.alloc(rng.choice((512, 8192, 3 * MiB, 12 * MiB)), stream=s))
                if len(held) > 8 or rng.random() < 0.5:
                    pool.free(held.pop(rng.randrange(len(held))))
        except BaseException as exc:   # re-raised below
            errors.append(exc)
        finally:
            for p in held:
                pool.free(p)

    def forgetter():
        rng = random.Random(99)
        while time.monotonic() < stop:
            pool.forget_stream(rng.randint(1, 6))
            if rng.random() < 0.1:
                pool.empty_cache()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=forgetter))
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    pool.check_invariants()
    for s in range(1, 7):
        pool.forget_stream(s)
    assert pool.stats()["num_streams"] == 1
    pool.empty_cache()
    pool.check_invariants()
    assert pool.reserved_bytes() == 0
    assert pool.device.counters()["errors"] == 0
