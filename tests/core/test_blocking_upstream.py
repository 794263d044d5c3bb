"""Note [Blocking upstream calls]: a Pool method lets the GIL go while its upstream call may
block, so other Python threads run meanwhile, and takes it back after.

The simulated device holds segment allocations on request (``device.hold_allocs``): the call
waits inside the upstream until ``release_held`` or its timeout. A thread that kept the GIL
through the wait would keep the main thread from seeing the call held at all.
"""
import threading
import time

import pytest

import mempool
from mempool import _core

MiB = 1 << 20
WAIT = 5.0   # seconds: the hold's timeout, and how long the main thread looks for it


def wait_until_held(device, n=1):
    """True once `n` allocations wait in the device; False after WAIT seconds.

    Python runs here (the loop, time.sleep's return) only while no other thread holds the
    GIL."""
    deadline = time.monotonic() + WAIT
    while device.held < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:   # re-raised by the test
            out["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def finish(thread, out, device):
    device.release_held()
    thread.join(WAIT)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("stream", [None, 7])
def test_other_threads_run_while_an_allocation_waits_on_its_upstream(stream):
    pool = mempool.Pool(backend="sim")
    pool.device.hold_allocs(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.alloc(MiB, stream=stream))
    assert wait_until_held(pool.device), "the waiting thread kept the GIL"
    # The pool lock is not held meanwhile either: this thread uses the same pool (a block
    # of another segment, so its own upstream call, no longer held).
    ptr = pool.alloc(512)
    pool.free(ptr)
    assert pool.used_bytes() == 0   # the held allocation is not handed out yet
    ptr = finish(thread, out, pool.device)
    assert pool.device.counters()["hold_timeouts"] == 0
    assert pool.used_bytes() >= MiB
    pool.free(ptr)
    pool.check_invariants()


def test_a_page_map_of_an_expandable_segment_lets_the_gil_go():
    pool = mempool.Pool(backend="sim", expandable_segments=True)
    pool.device.hold_allocs(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.alloc(4 * MiB))
    assert wait_until_held(pool.device), "the waiting thread kept the GIL"
    # The range's pages being mapped are marked busy; this thread's request maps its own.
    other = pool.alloc(512, stream=7)
    ptr = finish(thread, out, pool.device)
    assert pool.device.counters()["hold_timeouts"] == 0
    assert pool.reserved_bytes() == pool.stats()["mapped_bytes.current"] >= 4 * MiB
    pool.free(other)
    pool.free(ptr)
    pool.check_invariants()


def test_a_growth_that_releases_first_lets_the_gil_go_once():
    """The release before a growth and the growth itself nest their hooks: the GIL goes
    once and comes back once, and the pool ends consistent."""
    pool = mempool.Pool(backend="sim", limit=24 * MiB)
    big = pool.alloc(20 * MiB)
    pool.free(big)                       # an idle 20 MiB segment, in the way of the next
    pool.device.hold_allocs(1, timeout=WAIT)
    thread, out = in_thread(lambda: pool.alloc(22 * MiB))
    assert wait_until_held(pool.device), "the waiting thread kept the GIL"
    ptr = finish(thread, out, pool.device)
    stats = pool.stats()
    assert stats["num_device_free"] == 1 and stats["num_device_alloc"] == 2
    pool.free(ptr)
    pool.check_invariants()
    # The thread is marked no longer: a later call on it holds the GIL as usual.
    assert pool.alloc(512) and pool.used_bytes() == 512


def test_calls_that_did_not_mark_their_thread_keep_their_gil_state():
    """A core call made without the GIL (the compiled loop, as the PyTorch entry points and
    DLPack deleters are) must not have the hooks touch the GIL: it holds none to give."""
    pool = mempool.Pool(backend="sim")
    pool.device.hold_allocs(1, timeout=WAIT)
    thread, out = in_thread(lambda: _core.bench_core_roundtrips(pool, MiB, 3))
    assert wait_until_held(pool.device)
    assert finish(thread, out, pool.device) > 0
    assert pool.device.counters()["hold_timeouts"] == 0
    assert pool.used_bytes() == 0
    pool.check_invariants()


def test_a_hold_that_times_out_is_counted_and_the_call_goes_on():
    pool = mempool.Pool(backend="sim")
    pool.device.hold_allocs(1, timeout=0.05)
    ptr = pool.alloc(MiB)                # nobody releases it: it waits 50 ms, then goes on
    assert pool.device.counters()["hold_timeouts"] == 1
    assert pool.device.held == 0
    pool.free(ptr)
    pool.check_invariants()


@pytest.mark.parametrize("args, message", [
    ((-1,), "n must be >= 0"),
    ((1.5,), "n must be an integer"),
    ((1, 0), "timeout must be a number of seconds"),
    ((1, "2"), "timeout must be a number of seconds"),
    ((1, True), "timeout must be a number of seconds"),
])
def test_hold_allocs_refuses_bad_arguments(args, message):
    pool = mempool.Pool(backend="sim")
    with pytest.raises((TypeError, ValueError), match=message):
        pool.device.hold_allocs(*args)
    ptr = pool.alloc(MiB)                # nothing was held
    assert pool.device.counters()["hold_timeouts"] == 0
    pool.free(ptr)
