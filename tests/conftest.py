"""Shared fixtures. The CPU tier runs everywhere; tests marked ``gpu`` need a CUDA device."""
import faulthandler
import os
import sys

import pytest

import mempool

BASE = 1 << 40   # the simulated device's first address
MiB = 1 << 20
GiB = 1 << 30


def gpu_available():
    try:
        from mempool import _cuda
        return _cuda.available()
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA device")


def pytest_unconfigure(config):
    """MEMPOOL_TEST_EXIT_WATCHDOG=N: if the process has not exited N seconds after the run
    ends (a pool teardown or a driver call stuck at interpreter exit), print every
    thread's stack and exit, so the hang is seen rather than cut by an outer time limit."""
    seconds = os.environ.get("MEMPOOL_TEST_EXIT_WATCHDOG")
    if seconds:
        faulthandler.dump_traceback_later(float(seconds), exit=True, file=sys.stderr)


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _pool_factory(backend):
    """Make pools of one backend; their invariants are checked after the test."""
    pools = []

    def make(**options):
        pool = mempool.Pool(backend=backend, **options)
        pools.append(pool)
        return pool

    return make, pools


@pytest.fixture
def sim():
    """Factory of fresh pools on the simulated device."""
    make, pools = _pool_factory("sim")
    yield make
    for pool in pools:
        pool.check_invariants()


@pytest.fixture
def host():
    """Factory of fresh pools on host memory."""
    make, pools = _pool_factory("host")
    yield make
    for pool in pools:
        pool.check_invariants()


def blocks(pool):
    """[(offset from BASE, size, state)] of every block, in address order."""
    out = []
    for seg in pool.layout():
        for b in seg["blocks"]:
            out.append((b["address"] - BASE, b["size"], b["state"]))
    return out


def run_threads(target, argsets):
    """Run target(*args) in one thread per argument tuple, started together, all joined."""
    import threading
    threads = [threading.Thread(target=target, args=tuple(args)) for args in argsets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def fetch_text(url, timeout=2, attempts=20):
    """GET `url` and return its body: a bounded retry loop, for a server thread that may
    still be starting (the metrics endpoints)."""
    import time
    import urllib.request
    last = None
    for _ in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.read().decode()
        except OSError as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"no answer from {url} after {attempts} attempts: {last}")
