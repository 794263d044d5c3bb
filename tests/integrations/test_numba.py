"""The Numba EMM plugin (mempool.numba) without a GPU: its logic against a fake context on
the simulated device, and Numba's plugin hand-shake (importing Numba only when used:
tests/integrations/test_integrations_import.py)."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

import mempool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, env=None):
    """Run `code` in a fresh interpreter at the repository root; its stdout."""
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


numba_cuda = pytest.importorskip("numba.cuda", reason="the plugin subclasses Numba's EMM "
                                 "base classes (pip install numba-cuda)")
import mempool.numba as mn            # noqa: E402
from numba.cuda.cudadrv import driver  # noqa: E402

MiB = 1 << 20


class FakeDevice:
    def __init__(self, id):
        self.id = id


class FakeContext:
    """What the manager reads of Numba's Context: the device's ordinal."""

    def __init__(self, device=0):
        self.device = FakeDevice(device)


@pytest.fixture
def pools(monkeypatch):
    """Fresh module state: no pool chosen; a sim pool per device on request."""
    monkeypatch.setattr(mn, "_pools", {})

    def make(device=0, **options):
        options.setdefault("capacity", 1 << 30)
        pool = mempool.Pool(backend="sim", device=device, **options)
        mn.use(pool)
        return pool

    return make


@pytest.fixture
def manager():
    mgr = mn.MempoolNumbaManager(context=FakeContext(0))
    mgr.initialize()
    return mgr


def test_numba_accepts_the_plugin_and_its_version():
    cls = mn.MempoolNumbaManager
    assert issubclass(cls, numba_cuda.HostOnlyCUDAMemoryManager)
    assert cls(context=None).interface_version == 1
    assert mn._numba_memory_manager is cls       # what NUMBA_CUDA_MEMORY_MANAGER looks up


def test_numba_memory_manager_env_var_installs_the_plugin():
    out = _run("""
        from numba.cuda.cudadrv import driver
        driver._ensure_memory_manager()
        m = driver._memory_manager
        print(m.__module__, m.__name__)
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "mempool.numba"})
    assert out.split() == ["mempool.numba", "MempoolNumbaManager"]


def test_memalloc_gives_a_pool_block_freed_when_the_pointer_goes(pools, manager):
    pool = pools()
    mem = manager.memalloc(1000)
    ptr = mem.device_pointer_value
    assert pool.block_info(ptr) == (1024, 1000, 0)      # Numba's default (legacy) stream
    assert mem.size == 1000 and pool.used_bytes() == 1024
    del mem
    gc.collect()
    assert pool.used_bytes() == 0
    assert not manager.allocations                      # nothing left in Numba's books
    pool.check_invariants()


def test_a_view_keeps_the_block_after_the_array_goes(pools, manager):
    pool = pools()
    mem = manager.memalloc(4096)
    view = mem.view(512, 1024)
    assert view.device_pointer_value == mem.device_pointer_value + 512
    del mem
    gc.collect()
    assert pool.used_bytes() == 4096
    del view
    gc.collect()
    assert pool.used_bytes() == 0


def test_allocations_on_a_stream_are_freed_on_it(pools, manager):
    pool = pools()
    with mn.stream(0x5000):
        mem = manager.memalloc(MiB)
    ptr = mem.device_pointer_value
    assert pool.block_info(ptr)[2] == 0x5000
    outside = manager.memalloc(512)
    assert pool.block_info(outside.device_pointer_value)[2] == 0   # the scope ended
    pool.device.launch(0x5000)          # work still queued on the stream when it is freed
    del mem
    gc.collect()
    (freed,) = [b for s in pool.layout() for b in s["blocks"]
                if b["address"] == ptr and b["state"] == 0]
    assert freed["stream"] == 0x5000    # in the stream's own lists, no sync made
    assert pool.stats()["num_sync_all_streams"] == 0
    with mn.stream(0x5000):             # that stream takes it back at once
        again = manager.memalloc(MiB)
    assert again.device_pointer_value == ptr


def test_the_per_thread_default_stream_when_numba_uses_it(pools, manager, monkeypatch):
    pool = pools()
    monkeypatch.setattr(mn, "_default_stream", lambda: 2)
    mem = manager.memalloc(512)
    assert pool.block_info(mem.device_pointer_value)[2] == 2


def test_a_numba_stream_object_is_pinned_by_the_pool(pools, manager):
    pool = pools()

    class OldNumbaStream:              # a release whose streams lack __cuda_stream__
        def __init__(self, value):
            import ctypes
            self.handle = ctypes.c_void_p(value)

    s = OldNumbaStream(0x7000)
    with mn.stream(s):
        mem = manager.memalloc(512)
    assert pool.block_info(mem.device_pointer_value)[2] == 0x7000
    assert pool.pinned_streams[0x7000].stream is s


def test_defer_cleanup_holds_frees_until_the_outermost_block_ends(pools, manager):
    pool = pools()
    with manager.defer_cleanup():
        a = manager.memalloc(MiB)
        with manager.defer_cleanup():
            b = manager.memalloc(MiB)
            del a, b
            gc.collect()
            assert pool.used_bytes() == 2 * MiB and manager._held.held == 2
        assert pool.used_bytes() == 2 * MiB          # the outer block still holds them
    assert pool.used_bytes() == 0 and manager._held.held == 0
    pool.check_invariants()


def test_reset_frees_everything_held(pools, manager):
    pool = pools()
    kept = manager.memalloc(MiB)
    with manager.defer_cleanup():
        dropped = manager.memalloc(MiB)
        del dropped
        gc.collect()
        manager.reset()
        assert pool.used_bytes() == 0
    with pytest.raises(ReferenceError):              # as under Numba's own manager
        kept.device_pointer_value
    del kept
    gc.collect()                                     # no second free of its block
    pool.check_invariants()


def test_memory_info_comes_from_the_pool(pools, manager):
    pool = pools(limit=256 * MiB)
    assert tuple(manager.get_memory_info()) == (256 * MiB, 256 * MiB)
    mem = manager.memalloc(30 * MiB)                 # a 30 MiB segment, all of it live
    assert tuple(manager.get_memory_info()) == (226 * MiB, 256 * MiB)
    del mem
    gc.collect()                                     # cached again: free for the pool
    assert tuple(manager.get_memory_info()) == (256 * MiB, 256 * MiB)
    assert pool.reserved_bytes() == 30 * MiB


def test_memory_info_without_a_limit_is_the_devices(pools, manager):
    pool = pools(capacity=64 * MiB)
    mem = manager.memalloc(MiB)                      # a 2 MiB segment
    assert tuple(manager.get_memory_info()) == (63 * MiB, 64 * MiB)
    assert pool.block_info(mem.device_pointer_value)[0] == MiB


def test_memory_info_refuses_a_cuda_pool_without_the_device_figure():
    class CudaLike:
        backend = "cuda"
        options = {"limit": None}
        capacity = 1 << 30

        def cached_bytes(self):
            return 0
        device = None
    with pytest.raises(ValueError, match="device_free"):
        mn.memory_info(CudaLike())


def test_ipc_is_refused_on_sim_and_host_saying_why(pools, manager):
    pools()
    mem = manager.memalloc(512)
    with pytest.raises(mn.IpcNotSupportedError, match="simulated addresses"):
        manager.get_ipc_handle(mem)
    host = mempool.Pool(backend="host", capacity=64 * MiB)
    mn.use(host)
    with pytest.raises(mn.IpcNotSupportedError, match="host memory"):
        manager.get_ipc_handle(mem)


def test_the_pool_follows_the_context_device(pools):
    p0, p1 = pools(0), pools(1)
    m1 = mn.MempoolNumbaManager(context=FakeContext(1))
    mem = m1.memalloc(512)
    assert p1.used_bytes() == 512 and p0.used_bytes() == 0
    del mem
    gc.collect()
    assert p1.used_bytes() == 0


class HandleContext:
    """A context built around a handle another library retained: Numba's tests make one as
    driver.Context(CUdevice(0), handle), whose device is the driver's CUdevice."""

    def __init__(self, device):
        self.device = device


def test_a_context_made_around_a_handle_finds_its_pool_by_the_cudevice(pools):
    """Numba's own test_attached_primary: the context's device is a CUdevice, with no .id."""
    from cuda.bindings.driver import CUdevice

    p0, p1 = pools(0), pools(1)
    mgr = mn.MempoolNumbaManager(context=HandleContext(CUdevice(1)))
    mgr.initialize()
    mem = mgr.memalloc(512)
    assert p1.used_bytes() == 512 and p0.used_bytes() == 0
    del mem
    gc.collect()
    assert p1.used_bytes() == 0


def test_a_context_whose_device_has_no_ordinal_is_refused_saying_what_it_got(pools):
    pool = pools(0)

    class Unknown:
        def id(self):     # a method, as a unittest.TestCase's: not an ordinal
            return "x"

    mgr = mn.MempoolNumbaManager(context=HandleContext(Unknown()))
    with pytest.raises(TypeError, match="cannot tell the device.*device is a Unknown, with "
                                        "no integer id"):
        mgr.memalloc(512)
    assert pool.used_bytes() == 0


def test_a_block_goes_back_to_its_own_pool_after_use_changes(pools, manager):
    first = pools()
    mem = manager.memalloc(512)
    second = pools()
    assert mn.pool_for(0) is second
    del mem
    gc.collect()
    assert first.used_bytes() == 0 and second.used_bytes() == 0
    first.check_invariants()


def test_without_use_the_default_pool_serves(monkeypatch, manager):
    monkeypatch.setattr(mn, "_pools", {})
    monkeypatch.setattr(mempool, "_default_pools", {})
    monkeypatch.setenv("MEMPOOL_CONF", "backend:sim,capacity:1GiB,limit:128MiB")
    mem = manager.memalloc(512)
    pool = mempool.default_pool(0)
    assert pool.block_info(mem.device_pointer_value)[1] == 512
    assert pool.options["limit"] == 128 * MiB
    assert manager.get_memory_info().total == 128 * MiB


def test_out_of_memory_is_the_pools_error(pools, manager):
    pools(limit=4 * MiB)
    with pytest.raises(mempool.OutOfMemoryError, match="limit"):
        manager.memalloc(8 * MiB)


def test_a_real_context_refuses_a_pool_kernels_cannot_use(pools):
    pools()
    ctx = object.__new__(driver.Context)       # a Context as Numba makes it, minus the GPU
    ctx.device = FakeDevice(0)
    mgr = mn.MempoolNumbaManager(context=ctx)
    with pytest.raises(ValueError, match="backend 'sim'.*Pool\\(backend='cuda'\\)"):
        mgr.memalloc(512)


def test_record_stream_declares_another_stream(pools, manager):
    pool = pools()
    mem = manager.memalloc(4096)
    ptr = mem.device_pointer_value

    class Array:   # what record_stream reads of a device array
        __cuda_array_interface__ = {"data": (ptr, False)}

    mn.record_stream(Array(), 0x9000)
    pool.device.launch(0x9000)
    del mem
    gc.collect()
    states = [b["state"] for s in pool.layout() for b in s["blocks"] if b["address"] == ptr]
    assert states == [2]                          # pending on the recorded stream's work
    pool.device.complete(0x9000)


def test_bad_arguments_are_refused_and_change_nothing(pools, manager):
    pool = pools()
    with pytest.raises(TypeError, match="mempool.Pool"):
        mn.use("pool")
    assert mn.pool_for(0) is pool
    with pytest.raises(TypeError, match="got bool"):
        with mn.stream(True):
            pass
    with pytest.raises(TypeError, match="got str"):
        with mn.stream("s"):
            pass
    with pytest.raises(ValueError, match="2\\*\\*64"):
        with mn.stream(-1):
            pass
    assert getattr(mn._scope, "stream", None) is None
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        mn.record_stream(object(), 0)
    with pytest.raises(TypeError, match="not None"):
        mn.record_stream(object(), None)

    class Stranger:
        __cuda_array_interface__ = {"data": (0x1234, False)}
    with pytest.raises(ValueError, match="not the start of a live block"):
        mn.record_stream(Stranger(), 0)
    assert pool.used_bytes() == 0


def test_install_refuses_when_numba_chose_another_manager(monkeypatch):
    monkeypatch.setattr(driver, "_memory_manager", driver.NumbaCUDAMemoryManager)
    with pytest.raises(RuntimeError, match="NumbaCUDAMemoryManager.*before Numba's first"):
        mn.install()
    assert driver._memory_manager is driver.NumbaCUDAMemoryManager


def test_install_sets_numba_manager_and_pool(monkeypatch, pools):
    monkeypatch.setattr(driver, "_memory_manager", None)
    pool = mempool.Pool(backend="sim", capacity=1 << 30)
    assert mn.install(pool) is mn.MempoolNumbaManager
    assert driver._memory_manager is mn.MempoolNumbaManager
    assert mn.pool_for(0) is pool
