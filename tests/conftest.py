"""Shared fixtures. The CPU tier runs everywhere; tests marked ``gpu`` need a CUDA device.
Shared functions and constants are in _support.py (tests import them from there, never
from this file or from one another)."""
import faulthandler
import os
import sys

import pytest

import mempool
from _fake_cuda import build_fake_driver
from _gpu_fixtures import cuda_pool, cupy_device, held_cupy_arrays, kernels, streams  # noqa: F401
from _support import gpu_available


def pytest_unconfigure(config):
    """MEMPOOL_TEST_EXIT_WATCHDOG=N: if the process has not exited N seconds after the run
    ends (a pool teardown or a driver call stuck at interpreter exit), print every
    thread's stack and exit, so the hang is seen rather than cut by an outer time limit."""
    seconds = os.environ.get("MEMPOOL_TEST_EXIT_WATCHDOG")
    if seconds:
        faulthandler.dump_traceback_later(float(seconds), exit=True, file=sys.stderr)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """With pytest-xdist installed, the run is spread over one process per CPU unless the
    command line says how (`-n N`, `-n 0` for one process) or asks for a debugger. Set here
    rather than in addopts so that a pytest without pytest-xdist still runs the tests."""
    if not config.pluginmanager.hasplugin("xdist") or config.option.usepdb:
        return
    # Neither a worker nor a pytest that a test starts (they inherit the variable) starts
    # workers of its own.
    if hasattr(config, "workerinput") or os.environ.get("MEMPOOL_TEST_PARALLEL_STARTED"):
        return
    os.environ["MEMPOOL_TEST_PARALLEL_STARTED"] = "1"
    if getattr(config.option, "numprocesses", None) is None:
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            # Idle workers take tests queued for busy ones: a few tests take far longer
            # than the rest.
            config.option.dist = "worksteal"


# Files every test of which is marked slow here rather than in the file: the surface fuzzer
# runs for MEMPOOL_FUZZ_SECONDS of wall time whatever the machine.
SLOW_FILES = ("test_fuzz_surface.py",)


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    if not gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # Another worker's test may hold device memory at any time.
        skip = pytest.mark.skip(reason="gpu_exclusive: needs the device alone, not shared "
                                       "with other pytest-xdist workers (run with -n 0 or -n 1)")
        for item in items:
            if "gpu_exclusive" in item.keywords:
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


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory):
    """The stand-in libcuda.so.1, compiled once (tests/_fake_cuda.py)."""
    return build_fake_driver(tmp_path_factory)
