"""PyTorch's pluggable allocator: the C entry points through ctypes on sim and host pools,
and (GPU tier) the allocator installed into real PyTorch.

ctypes calls foreign functions with the GIL released, so the entry points run here as they
do under PyTorch: plain C calls from any thread, without the GIL.
"""
import ctypes
import gc
import shutil
import subprocess
import sys
import threading

import pytest

import mempool
from mempool import _core

MiB = 1 << 20

_ep = _core._torch_entry_points()
alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(_ep["alloc"])
free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(_ep["free"])
record_stream = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(_ep["record_stream"])
reset = ctypes.CFUNCTYPE(None)(_ep["reset"])
memory_fraction = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(_ep["memory_fraction"])
base_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_size_t))(_ep["base_alloc"])


def has_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.fixture
def table():
    """Registrations made by a test are undone after it, whatever it left."""
    used = []

    def register(device, pool):
        _core._torch_register(device, pool)
        used.append(device)
        return pool

    yield register
    for d in used:
        try:
            _core._torch_unregister(d)
        except RuntimeError:
            pass


def sim(capacity="1GB", **kw):
    return mempool.Pool(backend="sim", capacity=capacity, **kw)


# ---- routing --------------------------------------------------------------------------------

def test_each_device_routes_to_its_own_pool(table):
    a = table(0, sim())
    b = table(3, sim(device=3))
    pa = alloc(4 * MiB, 0, None)
    pb = alloc(1 * MiB, 3, None)
    assert pa and pb
    assert a.used_bytes() >= 4 * MiB and a.used_bytes() < 5 * MiB
    assert MiB <= b.used_bytes() < 2 * MiB
    assert _core._torch_counters(0)["live_blocks"] == 1
    free(pa, 4 * MiB, 0, None)
    free(pb, MiB, 3, None)
    assert a.used_bytes() == 0 and b.used_bytes() == 0
    assert _core._torch_counters(0)["live_blocks"] == 0
    a.check_invariants()
    b.check_invariants()


@pytest.mark.parametrize("device", [1, 7, 63, -1, 64, 1000])
def test_unregistered_or_invalid_device_gets_null(table, device):
    table(0, sim())
    assert alloc(1024, device, None) is None


def test_size_zero_gets_null_and_null_free_is_ignored(table):
    p = table(0, sim())
    assert alloc(0, 0, None) is None
    free(None, 0, 0, None)
    free(0x1234, 16, 0, None)        # not a block of this pool: ignored
    assert p.used_bytes() == 0
    p.check_invariants()


def test_host_pool_memory_is_usable(table):
    p = table(0, mempool.Pool(backend="host", capacity="64MB"))
    ptr = alloc(4096, 0, None)
    ctypes.memset(ptr, 0xAB, 4096)
    assert ctypes.string_at(ptr + 4095, 1) == b"\xab"
    free(ptr, 4096, 0, None)
    assert p.used_bytes() == 0


def test_out_of_memory_returns_null_and_says_why(table, capfd):
    table(0, sim(capacity="64MB"))
    assert alloc(512 * MiB, 0, None) is None
    assert _core._torch_counters(0)["failed_allocs"] >= 1
    assert "mempool: torch allocation of 536870912 bytes" in capfd.readouterr().err


def test_live_block_count_follows_only_blocks_handed_out(table):
    """The slot's count of torch's blocks (what keeps a pool registered) moves with real
    blocks only: not with a refused allocation, nor a free of a pointer the pool does not
    know, nor a second free."""
    p = table(0, sim(capacity="64MB"))
    live = lambda: _core._torch_counters(0)["live_blocks"]   # noqa: E731
    a = alloc(MiB, 0, None)
    assert live() == 1
    assert alloc(512 * MiB, 0, None) is None             # refused: out of memory
    assert live() == 1
    free(a + 512, MiB, 0, None)                          # inside a block: not a block
    free(0xDEAD000, MiB, 0, None)                        # unknown
    assert live() == 1
    free(a, MiB, 0, None)
    assert live() == 0
    free(a, MiB, 0, None)                                # freed already
    assert live() == 0 and p.used_bytes() == 0
    _core._torch_unregister(0)                           # nothing out: allowed
    p.check_invariants()


def test_registration_keeps_the_pool_alive(table):
    p = sim()
    table(0, p)
    del p
    gc.collect()
    ptr = alloc(MiB, 0, None)
    assert ptr
    free(ptr, MiB, 0, None)


def test_unregister_refused_while_torch_holds_blocks(table):
    table(0, sim())
    ptr = alloc(MiB, 0, None)
    with pytest.raises(RuntimeError, match="still holds 1 blocks"):
        _core._torch_unregister(0)
    with pytest.raises(RuntimeError, match="still holds"):
        _core._torch_register(0, sim())
    free(ptr, MiB, 0, None)
    _core._torch_unregister(0)
    assert alloc(MiB, 0, None) is None


def test_a_pool_out_of_the_table_refuses_entry_points_that_read_it_before(table):
    """Note [Torch table lifetime]: an alloc that read the slot just before a change finds
    the pool retired (and reads the slot again) instead of handing out a block PyTorch would
    free to another pool; the struct of a pool that was in the table outlives the pool."""
    p = table(0, sim())
    address = _core._torch_pool_address(0)
    assert address != 0
    code, ptr = _core._torch_alloc_at(address, MiB)     # in the table: an ordinary block
    assert code == "ok" and ptr
    assert _core._torch_counters(0)["live_blocks"] == 1
    free(ptr, MiB, 0, None)
    assert _core._torch_counters(0)["live_blocks"] == 0

    _core._torch_unregister(0)
    assert _core._torch_alloc_at(address, MiB) == ("retired", 0)
    assert p.used_bytes() == 0                          # nothing was handed out
    table(0, p)                                         # back in: served again
    code, ptr = _core._torch_alloc_at(address, MiB)
    assert code == "ok"
    free(ptr, MiB, 0, None)

    _core._torch_unregister(0)
    del p
    gc.collect()                                        # destroyed: its struct stays behind
    assert _core._torch_alloc_at(address, MiB) == ("retired", 0)


def test_torch_blocks_are_marked_in_the_pool(table):
    """The pool counts PyTorch's blocks itself (what a change checks), and check_invariants
    holds that count against the blocks marked as PyTorch's."""
    p = table(0, sim())
    ptrs = [alloc(n, 0, None) for n in (512, 3 * MiB, 40 * MiB)]
    own = p.alloc(4096)                                 # not PyTorch's: not counted
    assert _core._torch_counters(0)["live_blocks"] == 3
    p.check_invariants()
    for ptr, n in zip(ptrs, (512, 3 * MiB, 40 * MiB)):
        free(ptr, n, 0, None)
        p.check_invariants()
    assert _core._torch_counters(0)["live_blocks"] == 0
    p.free(own)
    again = alloc(512, 0, None)                         # the hot block, PyTorch's again
    assert _core._torch_counters(0)["live_blocks"] == 1
    p.check_invariants()
    free(again, 512, 0, None)
    assert _core._torch_counters(0)["live_blocks"] == 0


def test_reregistering_the_same_pool_is_a_no_op(table):
    p = table(0, sim())
    ptr = alloc(MiB, 0, None)
    _core._torch_register(0, p)        # same pool: fine even with blocks out
    assert _core._torch_is_registered(0, p)
    free(ptr, MiB, 0, None)


def test_register_checks_its_arguments():
    with pytest.raises(ValueError, match="device"):
        _core._torch_register(64, sim())
    with pytest.raises(TypeError, match="device"):
        _core._torch_register("cuda:0", sim())
    with pytest.raises(TypeError):
        _core._torch_register(0, object())


# ---- hooks ----------------------------------------------------------------------------------

def test_record_stream_hook_delays_reuse_until_the_stream_is_done(table):
    p = table(0, sim())
    s1, s2 = 0x1000, 0x2000
    ptr = alloc(MiB, 0, s1)
    record_stream(ptr, s2)
    p.device.launch(s2)                 # work queued on s2 that uses the block
    free(ptr, MiB, 0, s1)
    again = alloc(MiB, 0, s1)
    assert again != ptr, "reused while s2 still uses it"
    free(again, MiB, 0, s1)
    p.device.complete(s2)
    third = alloc(MiB, 0, s1)
    assert third == ptr, "after s2 completed, the block serves s1 again"
    free(third, MiB, 0, s1)
    p.check_invariants()


def test_record_stream_finds_the_pool_without_a_device(table):
    table(0, sim())
    q = table(2, sim(device=2))
    ptr = alloc(MiB, 2, 0x10)
    record_stream(ptr, 0x20)
    q.device.launch(0x20)
    free(ptr, MiB, 2, 0x10)
    assert alloc(MiB, 2, 0x10) != ptr
    q.device.complete_all()


def test_memory_fraction_hook_sets_the_limit(table):
    p = table(0, sim(capacity="1GB"))
    memory_fraction(0.25, 0)
    assert alloc(300 * MiB, 0, None) is None
    ok = alloc(200 * MiB, 0, None)
    assert ok
    free(ok, 200 * MiB, 0, None)
    memory_fraction(1.0, 0)
    big = alloc(600 * MiB, 0, None)
    assert big
    free(big, 600 * MiB, 0, None)
    memory_fraction(0.5, 9)              # unregistered device: nothing happens
    p.check_invariants()


def test_reset_hook_empties_every_registered_cache(table):
    a = table(0, sim())
    b = table(1, sim(device=1))
    for dev in (0, 1):
        free(alloc(8 * MiB, dev, None), 8 * MiB, dev, None)
    assert a.cached_bytes() > 0 and b.cached_bytes() > 0
    reset()
    assert a.cached_bytes() == 0 and b.cached_bytes() == 0


def test_base_alloc_hook(table):
    table(0, sim())
    ptr = alloc(3 * MiB, 0, None)
    size = ctypes.c_size_t(0)
    assert base_alloc(ptr, ctypes.byref(size)) == ptr
    assert size.value >= 3 * MiB
    size.value = 17
    assert base_alloc(0x42, ctypes.byref(size)) == 0x42 and size.value == 17
    free(ptr, 3 * MiB, 0, None)


# ---- threads --------------------------------------------------------------------------------

def test_concurrent_alloc_free_on_many_threads(table):
    p = table(0, sim(capacity="8GB"))
    q = table(1, mempool.Pool(backend="host", device=1, capacity="256MB"))
    errors = []

    def worker(seed):
        import random
        rng = random.Random(seed)
        held = []
        try:
            for _ in range(2000):
                if held and rng.random() < 0.5:
                    ptr, n, dev = held.pop(rng.randrange(len(held)))
                    free(ptr, n, dev, None)
                else:
                    dev = rng.choice((0, 1))
                    n = rng.choice((512, 4096, 100_000, 2 * MiB))
                    ptr = alloc(n, dev, seed)
                    if not ptr:
                        raise AssertionError(f"alloc({n}, {dev}) failed")
                    if dev == 1:
                        ctypes.memset(ptr, seed & 0xFF, min(n, 64))
                    held.append((ptr, n, dev))
            for ptr, n, dev in held:
                free(ptr, n, dev, None)
        except BaseException as exc:       # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k + 1,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert p.used_bytes() == 0 and q.used_bytes() == 0
    assert _core._torch_counters(0)["live_blocks"] == 0
    p.check_invariants()
    q.check_invariants()


def test_unregister_racing_entry_points_is_safe(table):
    """Registration changes while other threads allocate: no entry point ever sees a pool
    being torn down (each alloc either gets a block of a live pool or NULL)."""
    stop = threading.Event()
    errors = []

    def hammer():
        try:
            while not stop.is_set():
                ptr = alloc(4096, 5, None)
                if ptr:
                    free(ptr, 4096, 5, None)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for th in threads:
        th.start()
    changes = 0
    try:
        for _ in range(300):
            # Either change may be refused when a block is out at that instant; what must
            # never happen is a crash or a block of a dead pool.
            try:
                table(5, sim(device=5))
                changes += 1
            except RuntimeError as exc:
                assert "still holds" in str(exc)
            try:
                _core._torch_unregister(5)
                changes += 1
            except RuntimeError as exc:
                assert "still holds" in str(exc)
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[0]
    assert changes > 0
    _core._torch_unregister(5)
    assert _core._torch_counters(5)["live_blocks"] == 0


# ---- the shared object ----------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_entry_points_are_exported_from_the_extension():
    out = subprocess.run(["nm", "-D", "--defined-only", _core.__file__],
                         capture_output=True, text=True, check=True).stdout
    for name in ("mempool_torch_alloc", "mempool_torch_free", "mempool_torch_record_stream",
                 "mempool_torch_reset", "mempool_torch_memory_fraction",
                 "mempool_torch_base_alloc"):
        assert f" T {name}" in out, name


def test_ctypes_finds_the_symbols_by_name():
    lib = ctypes.CDLL(_core.__file__)
    assert ctypes.cast(lib.mempool_torch_alloc, ctypes.c_void_p).value == _ep["alloc"]
    assert ctypes.cast(lib.mempool_torch_free, ctypes.c_void_p).value == _ep["free"]


def test_importing_mempool_does_not_import_torch():
    code = ("import sys, mempool, mempool.torch, mempool.jax, mempool.cupy\n"
            "bad = [m for m in ('torch', 'jax', 'cupy') if m in sys.modules]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_torch_support_refuse_non_cuda_pools():
    import mempool.torch as mt
    with pytest.raises((ValueError, RuntimeError, ImportError)):
        mt.allocator(sim())
    with pytest.raises(ValueError, match="backend"):
        mt._check_pool(sim())
    with pytest.raises(TypeError, match="Pool"):
        mt._check_pool(object())


@pytest.mark.skipif(has_gpu(), reason="checks the message of a CPU-only PyTorch")
def test_cpu_torch_says_it_needs_cuda():
    pytest.importorskip("torch")
    import mempool.torch as mt
    with pytest.raises(RuntimeError, match="CUDA build"):
        mt._torch_cuda()


# ---- GPU tier -------------------------------------------------------------------------------


def test_from_pool_gives_a_tensor_on_pool_memory():
    torch = pytest.importorskip("torch")
    import mempool.torch as mt
    pool = mempool.Pool(backend="host", capacity="64MB")
    t = mt.from_pool(pool, (4, 4), torch.float64)
    assert t.dtype == torch.float64 and t.shape == (4, 4)
    assert pool.block_info(t.data_ptr())[1] == 128
    t.fill_(1)
    del t
    gc.collect()
    assert pool.used_bytes() == 0


def test_a_pool_is_registered_only_for_its_own_device():
    pool = sim(device=1)
    with pytest.raises(ValueError, match="device 0: the pool allocates on device 1"):
        _core._torch_register(0, pool)
