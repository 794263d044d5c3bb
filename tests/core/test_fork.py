"""Pools across fork() (Note [Pools across fork], mp_fork.c): the main thread forks while
other threads allocate, free, make buffers and empty the cache on a sim and a host pool.
Each child must find its inherited pools refusing at once with a clear error, never hang,
and must be able to make and use a pool of its own."""
import os
import threading
import time

import pytest

import mempool

FORKS = 1000
DEADLINE = 10.0          # seconds a child may take before it counts as hung

OK, NO_ERROR, WRONG_ERROR, OWN_POOL_FAILED, HUNG = 0, 3, 4, 5, -1


def child(pools):
    """What a forked child does; its exit code says how it went (os._exit: no cleanup)."""
    try:
        for pool in pools:
            for call in (lambda: pool.alloc(512), lambda: pool.stats(),
                         lambda: pool.empty_cache()):
                try:
                    call()
                except RuntimeError as exc:
                    if "forked child" not in str(exc) or str(os.getppid()) not in str(exc):
                        return WRONG_ERROR
                else:
                    return NO_ERROR
        own = mempool.Pool(backend="sim")
        own.free(own.alloc(4096))
        own.empty_cache()
        return OK if own.reserved_bytes() == 0 else OWN_POOL_FAILED
    except BaseException:
        return OWN_POOL_FAILED


def wait_with_deadline(pid):
    until = time.monotonic() + DEADLINE
    while time.monotonic() < until:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.0005)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return HUNG


def hammer(pool, stop, errors, seed):
    import random
    rnd = random.Random(seed)
    live = []
    try:
        while not stop.is_set():
            r = rnd.random()
            if r < 0.4 and len(live) < 8:
                live.append(pool.alloc(rnd.randrange(1, 4 << 20)))
            elif r < 0.8:
                if live:
                    pool.free(live.pop(rnd.randrange(len(live))))
            elif r < 0.9:
                pool.empty((rnd.randrange(1, 1 << 16),), dtype="uint8")   # dropped at once
            else:
                pool.empty_cache()
        for ptr in live:
            pool.free(ptr)
    except Exception as exc:
        errors.append(repr(exc))


@pytest.mark.slow
def test_fork_under_threads_never_hangs_a_child():
    pools = [mempool.Pool(backend="sim"), mempool.Pool(backend="host")]
    stop = threading.Event()
    errors = []
    threads = [threading.Thread(target=hammer, args=(pools[i % 2], stop, errors, i))
               for i in range(4)]
    for t in threads:
        t.start()
    outcomes = {}
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:
                os._exit(child(pools))
            code = wait_with_deadline(pid)
            outcomes[code] = outcomes.get(code, 0) + 1
            if code != OK:
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert outcomes == {OK: FORKS}, f"child outcomes {outcomes} (0 ok, 3 no error raised, " \
                                    f"4 a wrong error, 5 its own pool failed, -1 hung)"
    for pool in pools:   # the parent's pools are untouched by the forks
        pool.check_invariants()
        pool.empty_cache()
        assert pool.reserved_bytes() == 0


def test_inherited_pool_refuses_every_call_and_drops_quietly():
    pool = mempool.Pool(backend="host")
    ptr = pool.alloc(1 << 20)
    pid = os.fork()
    if pid == 0:
        code = OK
        for call in (lambda: pool.free(ptr), lambda: pool.alloc(1),
                     lambda: pool.record_stream(ptr, 1), lambda: pool.forget_stream(1),
                     lambda: pool.trim(0), lambda: pool.used_bytes()):
            try:
                call()
                code = NO_ERROR
            except RuntimeError as exc:
                if f"created in process {os.getppid()}" not in str(exc):
                    code = WRONG_ERROR
        del pool   # destroyed in the child: gives nothing back, touches nothing
        os._exit(code)
    assert wait_with_deadline(pid) == OK
    assert pool.used_bytes() == 1 << 20
    pool.free(ptr)
    pool.check_invariants()
