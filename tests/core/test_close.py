"""Pool.close() and the context-manager protocol (Note [Closing a pool], mempool/_pool.pxi).

A pool with live blocks refuses to close and is unchanged; close(force=True) gives them up;
every later call raises PoolClosedError; closing twice does nothing. Memory a Buffer exported
stays valid until its last holder lets go, and deleters running after the close free
nothing harmful. On sim and host; the CuPy hook through a stand-in cupy module in a child
process (the hook caches CuPy's classes for the life of the process)."""
import gc
import inspect
import subprocess
import sys
import textwrap
import threading
import time

import numpy
import pytest

import mempool
from mempool import _core

MiB = 1 << 20
WAIT = 5.0   # seconds: the hold's timeout, and how long the main thread looks for it

# Public attributes that stay readable once closed: what the pool was.
READABLE = {"backend", "device_id", "capacity", "options", "closed"}
# Public callables a closed pool still answers: close itself (a no-op) and the constructor.
ANSWERED = {"close", "from_conf"}


@pytest.fixture(params=["sim", "host"])
def make(request):
    def make(**options):
        options.setdefault("capacity", "1GiB")
        return mempool.Pool(backend=request.param, **options)
    return make


def closed_pool(make):
    pool = make()
    pool.free(pool.alloc(MiB))
    pool.close()
    return pool


# ---- refusal with live blocks ------------------------------------------------------------------

def test_close_with_live_blocks_is_refused_names_them_and_changes_nothing(make):
    pool = make()
    ptrs = [pool.alloc(n) for n in (1000, 3 * MiB, 512)]
    pool.free(pool.alloc(8 * MiB))                       # cached: not live
    before = (pool.layout(), pool.stats(), pool.reserved_bytes())
    with pytest.raises(RuntimeError, match=r"3 live block\(s\) of ") as refused:
        pool.close()
    message = str(refused.value)
    assert all(f"{p:#x}" in message for p in ptrs) and "force=True" in message
    assert "..." not in message
    assert not pool.closed
    assert (pool.layout(), pool.stats(), pool.reserved_bytes()) == before
    for p in ptrs:                                       # still usable
        pool.free(p)
    pool.free(pool.alloc(MiB))
    pool.check_invariants()
    pool.close()
    assert pool.closed


def test_the_refusal_shows_the_first_addresses_of_many():
    pool = mempool.Pool(backend="sim")
    ptrs = sorted(pool.alloc(512) for _ in range(10))
    with pytest.raises(RuntimeError, match="10 live block") as refused:
        pool.close()
    message = str(refused.value)
    assert all(f"{p:#x}" in message for p in ptrs[:4])
    assert f"{ptrs[4]:#x}" not in message and "..." in message
    pool.close(force=True)


def test_a_buffer_is_a_live_block(make):
    pool = make()
    buf = pool.empty(1000, "float64")
    with pytest.raises(RuntimeError, match="1 live block"):
        pool.close()
    del buf
    gc.collect()
    pool.close()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_force_must_be_a_bool(make, bad):
    pool = make()
    with pytest.raises(TypeError, match="'force'"):
        pool.close(force=bad)
    assert not pool.closed
    pool.close()


# ---- force ------------------------------------------------------------------------------------

def test_force_close_gives_live_blocks_up(make):
    pool = make()
    pool.alloc(5 * MiB)
    pool.alloc(100)
    pool.close(force=True)
    assert pool.closed


def test_force_close_gives_the_memory_back():
    # A pool that shares another's limit counts its reserved bytes there until they go
    # upstream (Note [Shared limit], mp_release.c): the owner sees the member's memory leave.
    owner = mempool.Pool(backend="sim", capacity="4GiB", limit="256MiB")
    member = mempool.Pool(backend="sim", capacity="4GiB")
    _core._share_limit(member, owner)
    member.alloc(200 * MiB)
    with pytest.raises(mempool.OutOfMemoryError):
        owner.alloc(100 * MiB)
    member.close(force=True)
    owner.free(owner.alloc(250 * MiB))
    owner.check_invariants()


def test_a_buffer_keeps_its_memory_past_a_force_close_until_released():
    owner = mempool.Pool(backend="sim", capacity="4GiB", limit="256MiB")
    member = mempool.Pool(backend="sim", capacity="4GiB")
    _core._share_limit(member, owner)
    buf = member.empty(200 * MiB, "uint8")
    member.close(force=True)
    assert buf.nbytes == 200 * MiB                       # the Buffer is still whole
    with pytest.raises(mempool.OutOfMemoryError):
        owner.alloc(100 * MiB)                           # its memory is still held
    del buf
    gc.collect()
    owner.free(owner.alloc(250 * MiB))                   # and goes with it


def test_dlpack_consumers_outlive_a_force_close_and_their_deleters_are_harmless():
    pool = mempool.Pool(backend="host", capacity="256MB")
    live0 = _core._dl_live_blocks()
    buf = pool.empty(1000, "float64")
    arr = numpy.from_dlpack(buf)
    cap = pool.empty(10).__dlpack__()                    # a capsule nobody consumed
    spare = pool.empty(0)                                # no block, a reference only
    pool.close(force=True)
    arr[:] = 2.0                                         # the memory is still the consumer's
    del buf
    gc.collect()
    assert arr.sum() == 2000.0
    del arr, cap, spare
    gc.collect()
    assert _core._dl_live_blocks() == live0


# ---- after close ------------------------------------------------------------------------------

def _dummy_arguments(method):
    """A value for each required parameter: a closed pool refuses before it reads them."""
    args = []
    for p in inspect.signature(method).parameters.values():
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(1)
    return args


def test_every_public_method_of_a_closed_pool_raises_pool_closed_error(make):
    pool = closed_pool(make)
    names = [n for n in dir(mempool.Pool) if not n.startswith("_")]
    methods = [n for n in names if callable(getattr(mempool.Pool, n)) and n not in ANSWERED]
    assert {"alloc", "free", "malloc", "stats", "summary", "empty", "record_stream", "trim",
            "snapshot", "use"} <= set(methods)
    for name in methods:
        method = getattr(pool, name)
        with pytest.raises(mempool.PoolClosedError, match="is closed"):
            method(*_dummy_arguments(method))
    properties = [n for n in names if n not in methods and n not in ANSWERED]
    for name in properties:
        if name in READABLE:
            getattr(pool, name)
        else:
            with pytest.raises(mempool.PoolClosedError, match="is closed"):
                getattr(pool, name)
    assert pool.backend in ("sim", "host") and pool.closed
    assert "closed" in repr(pool)


def test_closed_pool_error_is_a_runtime_error(make):
    pool = closed_pool(make)
    with pytest.raises(RuntimeError, match="make a new Pool"):
        pool.alloc(1)


def test_the_core_functions_that_take_a_pool_refuse_a_closed_one(make):
    pool = closed_pool(make)
    other = make()
    calls = [lambda: _core._capture_begin(pool), lambda: _core._capture_end(pool),
             lambda: _core._capture_known(pool), lambda: _core._share_limit(pool, other),
             lambda: _core._share_limit(other, pool),
             lambda: _core.bench_core_roundtrips(pool, 512, 1),
             lambda: _core._torch_register(0, pool), lambda: _core._torch_track_private(0, pool),
             lambda: pool.__init__(backend="sim"), lambda: pool.__enter__()]
    for call in calls:
        with pytest.raises(mempool.PoolClosedError):
            call()
    assert pool.closed and not _core._torch_is_registered(0)


def test_closing_twice_does_nothing(make):
    pool = make()
    pool.close()
    pool.close()
    pool.close(force=True)
    assert pool.closed


def test_a_closed_pool_leaves_live_pools(make):
    pool = make()
    assert any(p is pool for _, p in mempool.live_pools())
    pool.close()
    assert not any(p is pool for _, p in mempool.live_pools())


def test_an_uninitialised_pool_still_says_so():
    pool = mempool.Pool.__new__(mempool.Pool)
    with pytest.raises(RuntimeError, match="never initialised"):
        pool.close()
    assert not pool.closed


# ---- the with statement -----------------------------------------------------------------------

def test_a_with_block_closes_the_pool(make):
    with make() as pool:
        pool.free(pool.alloc(MiB))
    assert pool.closed


def test_a_with_block_left_with_live_blocks_raises_and_leaves_the_pool_open(make):
    with pytest.raises(RuntimeError, match="1 live block"):
        with make() as pool:
            ptr = pool.alloc(MiB)
    assert not pool.closed
    pool.free(ptr)
    pool.close()


def test_an_exception_leaving_a_with_block_force_closes_and_propagates(make):
    with pytest.raises(KeyError, match="boom"):
        with make() as pool:
            pool.alloc(MiB)
            raise KeyError("boom")
    assert pool.closed


# ---- what close refuses, whatever force -------------------------------------------------------

def test_close_is_refused_while_another_thread_is_inside_a_call():
    pool = mempool.Pool(backend="sim")
    pool.device.hold_allocs(1, timeout=WAIT)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("ptr", pool.alloc(MiB)))
    thread.start()
    deadline = time.monotonic() + WAIT
    while pool.device.held < 1:
        assert time.monotonic() < deadline, "the allocation never reached the device"
        time.sleep(0.001)
    for force in (False, True):
        with pytest.raises(RuntimeError, match="under way in other threads"):
            pool.close(force=force)
    assert not pool.closed
    pool.device.release_held()
    thread.join(WAIT)
    assert not thread.is_alive()
    pool.free(out["ptr"])
    pool.close()


def test_close_is_refused_while_the_pool_is_pytorchs_allocator(make):
    pool = make()
    _core._torch_register(pool.device_id, pool)
    try:
        for force in (False, True):
            with pytest.raises(RuntimeError, match="PyTorch's allocator"):
                pool.close(force=force)
        assert not pool.closed
    finally:
        _core._torch_unregister(pool.device_id)
    pool.close()


def test_the_hooks_refuse_a_closed_pool(make):
    pool = closed_pool(make)
    import mempool.cupy
    import mempool.torch
    for call in (lambda: mempool.cupy.set_allocator(pool),
                 lambda: mempool.cupy.from_pool(pool, 4),
                 lambda: mempool.torch.register(pool)):
        with pytest.raises(mempool.PoolClosedError, match="pool: the pool"):
            call()
    with pytest.raises(mempool.PoolClosedError, match="pool: the pool"):
        with mempool.cupy.use(pool):
            pass


# ---- the default pool -------------------------------------------------------------------------

def test_closing_the_default_pool_makes_the_next_call_a_fresh_one():
    device = _core.SIM_MAX_DEVICES - 1 if not mempool._cuda.available() else 0
    first = mempool.default_pool(device)
    assert mempool.default_pool(device) is first
    first.close(force=True)
    fresh = mempool.default_pool(device)
    assert fresh is not first and not fresh.closed
    assert mempool.default_pool(device) is fresh
    fresh.free(fresh.alloc(512))


# ---- CuPy's memory after a force close ---------------------------------------------------------

# A stand-in for the two classes of cupy.cuda the hook builds (the hook caches them for the
# process, so this runs in a child).
STAND_IN = """
import gc, sys, types
cupy = types.ModuleType("cupy")
cupy.cuda = types.ModuleType("cupy.cuda")
class UnownedMemory:
    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self.owner = ptr, size, owner
class MemoryPointer:
    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset
cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer = UnownedMemory, MemoryPointer
sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cupy.cuda
import mempool
"""


def run_child(body):
    code = STAND_IN + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("backend", ["sim", "host"])
def test_cupy_memory_of_a_force_closed_pool_frees_nothing_when_dropped(backend):
    out = run_child(f"""
        pool = mempool.Pool(backend={backend!r}, capacity="1GiB")
        mp = pool.malloc(1000)
        assert pool.used_bytes() == 1024
        try:
            pool.close()
        except RuntimeError as e:
            assert "1 live block" in str(e), e
        else:
            raise AssertionError("closed with CuPy memory out")
        pool.close(force=True)
        del mp
        gc.collect()
        mp = None
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_prometheus_samples_leave_a_closed_pool_out(make):
    from mempool import prometheus
    kept, gone = make(), closed_pool(make)
    kept.alloc(MiB)
    samples = prometheus.samples([kept, gone])
    assert len(samples) == 1 and samples[0]["allocated"] == MiB
    kept.close(force=True)
