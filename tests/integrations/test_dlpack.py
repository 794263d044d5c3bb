"""The DLPack bridge (mempool.Buffer) on a host pool, read by NumPy, CPU PyTorch and ctypes.

Covers the capsule ABI (names, versions, shapes, strides, byte offsets, dtype codes, flags),
ownership (the deleter runs exactly once, a Buffer exports any number of times and its block
goes with the last holder, the Pool may be dropped first), pointer identity between producer and consumer, deleters on other threads, and the
refusals (sim memory, other devices, bad streams, read-only to a legacy consumer).
"""
import ctypes
import gc
import itertools
import subprocess
import sys
import threading

import numpy
import pytest

import mempool
from mempool import _core
from _dlpack import IS_COPIED, READ_ONLY, capsule_name, consume, dims, managed

# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture
def pool():
    p = mempool.Pool(backend="host", capacity="256MB")
    yield p
    gc.collect()
    p.check_invariants()


def freed(pool):
    return pool.stats()["allocation.all.freed"]


# ---- capsules -------------------------------------------------------------------------------

def test_legacy_capsule_without_max_version(pool):
    buf = pool.empty((3, 4), "float32")
    cap = buf.__dlpack__()
    assert capsule_name(cap) == "dltensor"
    t = managed(cap).contents
    assert t.dl_tensor.data == buf.ptr
    assert (t.dl_tensor.device.device_type, t.dl_tensor.device.device_id) == (1, 0)
    assert dims(managed(cap)) == ((3, 4), (4, 1))
    assert (t.dl_tensor.dtype.code, t.dl_tensor.dtype.bits, t.dl_tensor.dtype.lanes) == (2, 32, 1)
    assert t.dl_tensor.byte_offset == 0


@pytest.mark.parametrize("max_version", [(1, 0), (1, 1), (2, 3)])
def test_versioned_capsule_for_new_consumers(pool, max_version):
    buf = pool.empty(10, "int16")
    cap = buf.__dlpack__(max_version=max_version)
    assert capsule_name(cap) == "dltensor_versioned"
    t = managed(cap).contents
    assert (t.version.major, t.version.minor) == (1, 0)
    assert t.flags == 0
    assert (t.dl_tensor.dtype.code, t.dl_tensor.dtype.bits) == (0, 16)


def test_old_max_version_gets_legacy(pool):
    assert capsule_name(pool.empty(2).__dlpack__(max_version=(0, 8))) == "dltensor"


def test_bad_max_version_is_a_type_error_and_changes_nothing(pool):
    buf = pool.empty(2)
    with pytest.raises(TypeError, match="max_version"):
        buf.__dlpack__(max_version="1.0")
    assert not buf.exported


@pytest.mark.parametrize("dtype, code, bits", [
    ("bool", 6, 8), ("int8", 0, 8), ("int16", 0, 16), ("int32", 0, 32), ("int64", 0, 64),
    ("uint8", 1, 8), ("uint16", 1, 16), ("uint32", 1, 32), ("uint64", 1, 64),
    ("float16", 2, 16), ("float32", 2, 32), ("float64", 2, 64),
    ("complex64", 5, 64), ("complex128", 5, 128),
])
def test_dtype_codes_and_numpy_round_trip(pool, dtype, code, bits):
    buf = pool.empty((2, 3), dtype)
    cap_t = buf.view().__dlpack__(max_version=(1, 0))
    t = managed(cap_t).contents
    assert (t.dl_tensor.dtype.code, t.dl_tensor.dtype.bits, t.dl_tensor.dtype.lanes) == (code, bits, 1)
    arr = numpy.from_dlpack(buf)
    assert arr.dtype == numpy.dtype(dtype) and arr.shape == (2, 3)
    assert arr.ctypes.data == buf.ptr


def test_bfloat16_code_when_ml_dtypes_present(pool):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    buf = pool.empty(4, ml_dtypes.bfloat16)
    cap_t = buf.__dlpack__(max_version=(1, 0))
    t = managed(cap_t).contents
    assert (t.dl_tensor.dtype.code, t.dl_tensor.dtype.bits, t.version.minor) == (4, 16, 0)
    buf8 = pool.empty(4, ml_dtypes.float8_e4m3fn)
    cap_t8 = buf8.__dlpack__(max_version=(1, 1))
    t8 = managed(cap_t8).contents
    # The float8 codes came with DLPack 1.1: the capsule says so.
    assert (t8.dl_tensor.dtype.code, t8.dl_tensor.dtype.bits, t8.version.minor) == (10, 8, 1)


@pytest.mark.parametrize("dtype, message", [
    ("object", "no DLPack equivalent"), ("U3", "no DLPack equivalent"),
    ([("a", "i4"), ("b", "f8")], "no DLPack equivalent"), (">f4", "native byte order"),
])
def test_dtypes_dlpack_cannot_describe_are_refused(pool, dtype, message):
    with pytest.raises(ValueError, match=message):
        pool.empty(4, dtype)
    assert pool.used_bytes() == 0


@pytest.mark.parametrize("dtype", [numpy.longdouble, numpy.clongdouble])
def test_long_double_types_are_refused_with_a_message(pool, dtype):
    """NumPy's longdouble and clongdouble (float128 and complex256 on x86-64) have DLPack
    kinds but no type consumers read; complex256's 256 bits overflowed DLPack's 8-bit `bits`
    field as an OverflowError (found by tests/project/test_fuzz_surface.py, from dtype '\\x10')."""
    if numpy.dtype(dtype).itemsize in (8, 16) and numpy.dtype(dtype).kind == "c":
        pytest.skip("clongdouble is complex128 on this platform")
    if numpy.dtype(dtype).itemsize == 8 and numpy.dtype(dtype).kind == "f":
        pytest.skip("longdouble is float64 on this platform")
    for shape in (0, 4):
        with pytest.raises(ValueError, match="no DLPack equivalent"):
            pool.empty(shape, dtype)
    assert pool.used_bytes() == 0


def test_bad_shapes_are_refused(pool):
    with pytest.raises(ValueError, match="shape"):
        pool.empty((2, -1))
    with pytest.raises(TypeError, match="shape"):
        pool.empty("big")
    with pytest.raises(TypeError, match="dtype"):
        pool.empty(4, dtype=3.5)
    assert pool.used_bytes() == 0


def test_buffer_is_not_constructed_directly():
    with pytest.raises(TypeError, match="Pool.empty"):
        mempool.Buffer()


def test_description(pool):
    buf = pool.empty((2, 5), "float64")
    assert buf.shape == (2, 5) and buf.ndim == 2 and buf.size == 10
    assert buf.dtype == numpy.float64 and buf.itemsize == 8 and buf.nbytes == 80
    assert buf.strides == (40, 8) and buf.offset == 0 and not buf.readonly
    assert buf.backend == "host" and buf.__dlpack_device__() == (1, 0)
    assert "shape=(2, 5)" in repr(buf) and "exported" not in repr(buf)
    assert pool.used_bytes() >= 80


def test_int_shape_and_zero_d(pool):
    assert pool.empty(7).shape == (7,)
    scalar = pool.empty((), "int32")
    arr = numpy.from_dlpack(scalar)
    assert arr.shape == () and arr.dtype == numpy.int32
    arr[()] = 42
    assert int(arr) == 42


def test_empty_buffer_has_no_block(pool):
    before = pool.used_bytes()
    buf = pool.empty((0, 3))
    assert buf.ptr == 0 and buf.nbytes == 0 and pool.used_bytes() == before
    cap_t = buf.view().__dlpack__(max_version=(1, 0))
    t = managed(cap_t).contents
    assert t.dl_tensor.data is None
    arr = numpy.from_dlpack(buf)
    assert arr.shape == (0, 3)


# ---- views, byte offsets, read-only ---------------------------------------------------------

def test_view_exports_a_byte_offset(pool):
    buf = pool.empty(64, "float32")
    base = numpy.from_dlpack(buf.view())
    base[:] = numpy.arange(64)
    v = buf.view((4, 4), offset=32)
    assert v.ptr == buf.ptr + 32 and v.offset == 32
    cap_t = v.view().__dlpack__(max_version=(1, 0))
    t = managed(cap_t).contents
    assert t.dl_tensor.data == buf.ptr and t.dl_tensor.byte_offset == 32
    assert dims(ctypes.pointer(t)) == ((4, 4), (4, 1))
    arr = numpy.from_dlpack(v)
    assert arr.ctypes.data == buf.ptr + 32
    assert arr[0, 0] == 8 and arr[3, 3] == 23


@pytest.mark.parametrize("dtype", [{0: None}, {"names": 1}, "flot32", [None]])
def test_a_dtype_numpy_cannot_read_is_refused_saying_what_is_accepted(pool, dtype):
    # NumPy's own reason was passed on, and for {0: None} it is a bare "object of type
    # 'NoneType' has no len()".
    with pytest.raises(TypeError, match="is not a NumPy dtype; accepted: bool") as err:
        pool.empty(0, dtype)
    assert "has no len()" not in str(err.value)
    assert pool.used_bytes() == 0


def test_view_with_another_dtype(pool):
    buf = pool.empty(8, "float32")
    v = buf.view(dtype="uint8")
    assert v.shape == (32,) and v.dtype == numpy.uint8 and v.ptr == buf.ptr
    w = buf.view(dtype="float64", offset=8)
    assert w.shape == (3,)


def test_view_bounds_and_alignment(pool):
    buf = pool.empty(16, "float32")
    with pytest.raises(ValueError, match="offset"):
        buf.view(offset=65)
    with pytest.raises(ValueError, match="misaligned"):
        buf.view(offset=2)
    with pytest.raises(ValueError, match="beyond"):
        buf.view((17,))
    with pytest.raises(ValueError, match="beyond"):
        buf.view((16,), offset=4)
    with pytest.raises(TypeError, match="offset"):
        buf.view(offset=1.5)


def test_readonly_view_sets_the_flag(pool):
    buf = pool.empty(5, "int32")
    ro = buf.view(readonly=True)
    assert ro.readonly
    cap_t = ro.view().__dlpack__(max_version=(1, 0))
    t = managed(cap_t).contents
    assert t.flags & READ_ONLY
    with pytest.raises(ValueError, match="writable"):
        ro.view(readonly=False)
    arr = numpy.from_dlpack(ro)
    assert not arr.flags.writeable


def test_readonly_refused_to_a_legacy_consumer(pool):
    ro = pool.empty(5).view(readonly=True)
    with pytest.raises(BufferError, match="read-only"):
        ro.__dlpack__()
    assert not ro.exported


# ---- ownership ------------------------------------------------------------------------------

def test_deleter_runs_exactly_once_when_the_consumer_is_done(pool):
    buf = pool.empty(1000, "float64")
    n0, live0 = freed(pool), _core._dl_live_blocks()
    arr = numpy.from_dlpack(buf)
    assert buf.exported and "exported" in repr(buf)
    del buf
    gc.collect()
    assert freed(pool) == n0, "the consumer still holds the block"
    arr[:] = 1.0
    del arr
    gc.collect()
    assert freed(pool) == n0 + 1
    assert _core._dl_live_blocks() == live0 - 1
    assert pool.used_bytes() == 0


def test_unconsumed_capsule_frees_once(pool):
    buf = pool.empty(100)
    n0 = freed(pool)
    cap = buf.__dlpack__(max_version=(1, 0))
    del buf
    gc.collect()
    assert freed(pool) == n0
    del cap
    gc.collect()
    assert freed(pool) == n0 + 1 and pool.used_bytes() == 0


def test_consumer_calls_deleter_once_and_capsule_leaves_it(pool):
    for versioned in (False, True):
        buf = pool.empty(100)
        n0 = freed(pool)
        cap = buf.__dlpack__(max_version=(1, 0) if versioned else None)
        t = consume(cap)
        del cap, buf
        gc.collect()
        assert freed(pool) == n0, "a used capsule must not free its tensor"
        t.contents.deleter(t)
        assert freed(pool) == n0 + 1


def test_a_buffer_exports_any_number_of_times(pool):
    # As NumPy, CuPy and PyTorch arrays do: a second np.from_dlpack was a BufferError.
    buf = pool.empty(10, "int32")
    a = numpy.from_dlpack(buf)
    b = numpy.from_dlpack(buf)
    assert buf.exported and "exported" in repr(buf)
    assert a.ctypes.data == b.ctypes.data == buf.ptr
    a[:] = 7
    assert (b == 7).all()
    # The Buffer keeps its own hold: views, interfaces and more exports still work.
    assert buf.view(offset=4).ptr == buf.ptr + 4
    assert buf.__array_interface__["data"][0] == buf.ptr
    c = numpy.from_dlpack(buf)
    assert (c == 7).all()


@pytest.mark.slow
@pytest.mark.parametrize("order", list(itertools.permutations(["buf", "a", "b", "cap"])))
def test_repeated_exports_free_the_block_once_whatever_the_order(pool, order):
    n0, live0 = freed(pool), _core._dl_live_blocks()
    held = {"buf": pool.empty(64, "float64")}
    held["a"] = numpy.from_dlpack(held["buf"])
    held["b"] = numpy.from_dlpack(held["buf"])
    held["cap"] = held["buf"].__dlpack__(max_version=(1, 0))    # never consumed
    held["a"][:] = 3.0
    for i, name in enumerate(order):
        del held[name]
        gc.collect()
        for other in ("a", "b"):
            if other in held:
                assert (held[other] == 3.0).all(), "the memory must stay while a holder lives"
        expected = n0 + 1 if i == len(order) - 1 else n0
        assert freed(pool) == expected, f"freed after dropping {order[:i + 1]}"
    assert _core._dl_live_blocks() == live0
    assert pool.used_bytes() == 0
    pool.check_invariants()


def test_buffer_dropped_before_its_capsules(pool):
    buf = pool.empty(32, "uint8")
    caps = [buf.__dlpack__(max_version=(1, 0)) for _ in range(3)] + [buf.__dlpack__()]
    tensors = [consume(c) for c in caps]
    n0 = freed(pool)
    del buf, caps
    gc.collect()
    for i, t in enumerate(tensors):
        assert freed(pool) == n0
        t.contents.deleter(t)
    assert freed(pool) == n0 + 1 and pool.used_bytes() == 0


def test_views_share_the_block_until_the_last_holder(pool):
    buf = pool.empty(16, "int64")
    a = numpy.from_dlpack(buf.view())
    b = numpy.from_dlpack(buf.view(offset=64))
    n0 = freed(pool)
    del buf
    gc.collect()
    a[8:] = 7
    assert (b == 7).all()
    del a
    gc.collect()
    assert freed(pool) == n0
    del b
    gc.collect()
    assert freed(pool) == n0 + 1


def test_buffer_dropped_unexported_frees(pool):
    n0 = freed(pool)
    buf = pool.empty(1 << 20, "uint8")
    assert pool.used_bytes() >= 1 << 20
    del buf
    gc.collect()
    assert freed(pool) == n0 + 1 and pool.used_bytes() == 0


def test_pool_dropped_while_an_array_uses_its_memory():
    p = mempool.Pool(backend="host", capacity="64MB")
    buf = p.empty(1024, "float32")
    arr = numpy.from_dlpack(buf)
    live0 = _core._dl_live_blocks()
    del buf, p
    gc.collect()
    arr[:] = numpy.arange(1024)        # the memory is still the array's
    assert arr.sum() == 1023 * 1024 / 2
    del arr
    gc.collect()
    # The last holder freed the block and, with it, the pool's last reference.
    assert _core._dl_live_blocks() == live0 - 1


def test_interpreter_exit_with_live_exports_and_no_pool():
    code = (
        "import numpy, mempool\n"
        "p = mempool.Pool(backend='host')\n"
        "keep = [numpy.from_dlpack(p.empty(100)) for _ in range(10)]\n"
        "caps = [p.empty(10).__dlpack__(max_version=(1, 0)) for _ in range(10)]\n"
        "bufs = [p.empty(10) for _ in range(10)]\n"
        "del p\n"
        "keep[3][:] = 1\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---- device, copy and stream arguments ------------------------------------------------------

def test_dl_device_must_be_our_own(pool):
    buf = pool.empty(3)
    cap = buf.view().__dlpack__(dl_device=(1, 0), max_version=(1, 0))
    assert capsule_name(cap) == "dltensor_versioned"
    with pytest.raises(BufferError, match="in place"):
        buf.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError, match="dl_device"):
        buf.__dlpack__(dl_device="cpu")
    assert not buf.exported


def test_copy_true_copies_on_host_and_keeps_the_buffer(pool):
    buf = pool.empty(6, "int32")
    numpy.from_dlpack(buf.view())[:] = [1, 2, 3, 4, 5, 6]
    cap = buf.__dlpack__(copy=True, max_version=(1, 0))
    t = managed(cap).contents
    assert t.flags & IS_COPIED and t.dl_tensor.data != buf.ptr
    assert not buf.exported
    copied = numpy.from_dlpack(buf, copy=True)
    assert copied.ctypes.data != buf.ptr and list(copied) == [1, 2, 3, 4, 5, 6]
    zero_copy = numpy.from_dlpack(buf, copy=False)
    assert zero_copy.ctypes.data == buf.ptr


def test_copy_must_be_a_bool(pool):
    with pytest.raises(TypeError, match="copy"):
        pool.empty(2).__dlpack__(copy="yes")


def test_host_streams(pool):
    buf = pool.empty(3)
    with pytest.raises(BufferError, match="only None"):
        buf.__dlpack__(stream=5)
    with pytest.raises(TypeError, match="stream"):
        buf.__dlpack__(stream="s")
    assert not buf.exported
    cap = buf.__dlpack__(stream=-1)
    assert capsule_name(cap) == "dltensor"


# ---- array interfaces -----------------------------------------------------------------------

def test_array_interface_shares_memory_and_keeps_the_buffer_alive(pool):
    buf = pool.empty((2, 2), "float32")
    arr = numpy.asarray(buf)
    assert arr.ctypes.data == buf.ptr and arr.shape == (2, 2)
    n0 = freed(pool)
    del buf
    gc.collect()
    assert freed(pool) == n0     # NumPy holds the Buffer as the array's base
    arr[:] = 3
    del arr
    gc.collect()
    assert freed(pool) == n0 + 1


def test_cuda_array_interface_absent_on_host(pool):
    assert not hasattr(pool.empty(2), "__cuda_array_interface__")


# ---- sim memory -----------------------------------------------------------------------------

def test_sim_buffers_refuse_export():
    p = mempool.Pool(backend="sim", capacity="1GB")
    buf = p.empty((4, 4))
    # The device query refuses too: PyTorch asks it first (and a CPU-only PyTorch would
    # fail with its own AssertionError on a kDLCUDA answer).
    with pytest.raises(BufferError, match="simulated"):
        buf.__dlpack_device__()
    with pytest.raises(BufferError, match="simulated"):
        buf.__dlpack__()
    with pytest.raises(BufferError, match="simulated"):
        numpy.from_dlpack(buf)
    assert not hasattr(buf, "__array_interface__")
    assert not hasattr(buf, "__cuda_array_interface__")
    assert not buf.exported


# ---- threads --------------------------------------------------------------------------------

def test_deleters_on_other_threads_without_the_gil(pool):
    """Consumers call deleters from their own threads. ctypes drops the GIL around a foreign
    call, so these deleters run truly concurrently, with no GIL, racing each other."""
    n0 = freed(pool)
    n = 400
    tensors = []
    for i in range(n):
        cap = pool.empty(64 + i, "float32").__dlpack__(max_version=(1, 0) if i % 2 else None)
        tensors.append(consume(cap))
    gc.collect()
    assert freed(pool) == n0

    def run(part):
        for t in part:
            t.contents.deleter(t)

    threads = [threading.Thread(target=run, args=(tensors[k::8],)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert freed(pool) == n0 + n
    assert pool.used_bytes() == 0
    pool.check_invariants()


def test_arrays_freed_on_other_threads(pool):
    n0 = freed(pool)
    arrays = [numpy.from_dlpack(pool.empty(128, "int32")) for _ in range(200)]
    box = [arrays]
    del arrays

    def drop():
        box[0].clear()

    th = threading.Thread(target=drop)
    th.start()
    th.join()
    gc.collect()
    assert freed(pool) == n0 + 200


# ---- CPU PyTorch ----------------------------------------------------------------------------

def test_torch_cpu_round_trip(pool):
    torch = pytest.importorskip("torch")
    buf = pool.empty((3, 5), "float32")
    check = numpy.from_dlpack(buf.view())
    t = torch.from_dlpack(buf)
    assert t.data_ptr() == buf.ptr and t.shape == (3, 5) and t.dtype == torch.float32
    assert t.stride() == (5, 1) and t.device.type == "cpu"
    t.fill_(2.5)
    assert (check == 2.5).all()
    n0 = freed(pool)
    del t, buf
    gc.collect()
    assert freed(pool) == n0, "the NumPy view still holds the block"
    del check
    gc.collect()
    assert freed(pool) == n0 + 1


@pytest.mark.parametrize("dtype", ["bool", "int8", "int16", "int32", "int64", "uint8",
                                   "float16", "float32", "float64", "complex64", "complex128"])
def test_torch_cpu_dtypes(pool, dtype):
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(pool.empty(4, dtype))
    assert t.dtype == getattr(torch, {"bool": "bool"}.get(dtype, dtype))


def test_torch_cpu_byte_offset_view(pool):
    torch = pytest.importorskip("torch")
    buf = pool.empty(32, "int32")
    numpy.from_dlpack(buf.view())[:] = numpy.arange(32)
    t = torch.from_dlpack(buf.view((2, 3), offset=16))
    assert t.data_ptr() == buf.ptr + 16
    assert t.tolist() == [[4, 5, 6], [7, 8, 9]]


def test_torch_cpu_readonly(pool):
    torch = pytest.importorskip("torch")
    ro = pool.empty(4, "float32").view(readonly=True)
    try:
        t = torch.from_dlpack(ro)
    except (BufferError, RuntimeError) as exc:   # a consumer may refuse read-only memory
        assert "read" in str(exc).lower()
    else:
        assert t.data_ptr() == ro.ptr


def test_torch_backward_frees_on_autograd_thread(pool):
    torch = pytest.importorskip("torch")
    n0 = freed(pool)
    x = torch.from_dlpack(pool.empty((64, 64), "float32")).normal_().requires_grad_()
    w = torch.from_dlpack(pool.empty((64, 64), "float32")).normal_().requires_grad_()
    loss = (x @ w).relu().sum()
    loss.backward()
    assert x.grad is not None
    del x, w, loss
    gc.collect()
    assert freed(pool) == n0 + 2 and pool.used_bytes() == 0


# ---- stream hand-off, on the simulated device -----------------------------------------------
# sim Buffers refuse __dlpack__ (fake addresses); _export_simulated runs the same export
# there so the ordering and the recorded use can be watched on the simulated streams.

P, C = 0x10, 0x20      # producer and consumer streams


@pytest.fixture
def simpool():
    p = mempool.Pool(backend="sim", capacity="4GB")
    yield p
    gc.collect()
    p.device.complete_all()
    p.check_invariants()


def test_consumer_stream_waits_for_the_producer_without_a_host_sync(simpool):
    dev = simpool.device
    buf = simpool.empty(1 << 20, "uint8", stream=P)
    seq = dev.launch(P)                       # the producer's writes, still queued
    assert not dev.ordered(C, P, seq)
    before = dev.counters()
    cap = _core._export_simulated(buf, stream=C, max_version=(1, 0))
    after = dev.counters()
    assert dev.ordered(C, P, seq), "the consumer's stream must wait for the producer's"
    assert after["syncs"] == before["syncs"], "no host synchronisation"
    assert after["waits"] == before["waits"] + 1
    assert after["live_events"] == before["live_events"], "the event is given back"
    assert dev.stream_info(P)["completed"] < seq
    t = consume(cap)
    assert t.contents.dl_tensor.data == buf.ptr
    t.contents.deleter(t)


def test_consumer_stream_is_recorded_so_the_block_waits_for_it(simpool):
    dev = simpool.device
    buf = simpool.empty(1 << 20, "uint8", stream=P)
    ptr = buf.ptr
    t = consume(_core._export_simulated(buf, stream=C, max_version=(1, 0)))
    del buf                                   # the producer lets go: the capsule holds it
    dev.launch(C)                             # the consumer's kernels on its stream
    t.contents.deleter(t)                     # the consumer drops it at once (host side)
    reused_only_after(simpool, ptr, [C])


def reused_only_after(simpool, ptr, consumers):
    """The 1 MiB block at `ptr`, freed, serves the producer again only once every consumer
    stream has completed, one after the other."""
    for stream in consumers:
        other = simpool.alloc(1 << 20, stream=P)
        assert other != ptr, f"reused while consumer stream {stream:#x} may still read it"
        simpool.free(other)
        simpool.device.complete(stream)
    again = simpool.alloc(1 << 20, stream=P)
    assert again == ptr, "once the consumers' work is done the block serves again"
    simpool.free(again)


def test_every_export_records_its_own_consumer(simpool):
    # Repeated export: each consumer is ordered after the producer and recorded on the
    # block, so the block waits for both consumers' work, whoever lets go last.
    dev = simpool.device
    C2 = 0x30
    buf = simpool.empty(1 << 20, "uint8", stream=P)
    ptr = buf.ptr
    seq = dev.launch(P)
    t1 = consume(_core._export_simulated(buf, stream=C, max_version=(1, 0)))
    t2 = consume(_core._export_simulated(buf, stream=C2, max_version=(1, 0)))
    assert dev.ordered(C, P, seq) and dev.ordered(C2, P, seq)
    dev.launch(C)
    dev.launch(C2)
    del buf
    t2.contents.deleter(t2)
    t1.contents.deleter(t1)
    reused_only_after(simpool, ptr, [C, C2])


def test_stream_minus_one_means_no_synchronisation(simpool):
    dev = simpool.device
    buf = simpool.empty(1 << 20, "uint8", stream=P)
    ptr = buf.ptr
    seq = dev.launch(P)
    before = dev.counters()
    t = consume(_core._export_simulated(buf, stream=-1, max_version=(1, 0)))
    del buf
    assert dev.counters()["waits"] == before["waits"] and not dev.ordered(C, P, seq)
    dev.launch(C)
    t.contents.deleter(t)
    assert simpool.alloc(1 << 20, stream=P) == ptr    # nothing recorded: reused at once


@pytest.mark.parametrize("stream, consumer", [(None, 0), (1, 0), (2, 2), (0x99, 0x99)])
def test_stream_values_of_the_array_api(simpool, stream, consumer):
    dev = simpool.device
    buf = simpool.empty(64, "float32", stream=P)
    seq = dev.launch(P)
    t = consume(_core._export_simulated(buf, stream=stream, max_version=(1, 0)))
    assert dev.ordered(consumer, P, seq)
    t.contents.deleter(t)


def test_same_stream_needs_no_event(simpool):
    dev = simpool.device
    buf = simpool.empty(64, "float32", stream=P)
    before = dev.counters()
    t = consume(_core._export_simulated(buf, stream=P, max_version=(1, 0)))
    assert dev.counters()["event_records"] == before["event_records"]
    t.contents.deleter(t)


@pytest.mark.parametrize("stream", [0, -2])
def test_invalid_dlpack_streams_are_refused(simpool, stream):
    buf = simpool.empty(8, stream=P)
    with pytest.raises(BufferError, match="not a valid DLPack stream"):
        _core._export_simulated(buf, stream=stream)
    assert not buf.exported


def test_sim_capsule_describes_a_cuda_tensor(simpool):
    buf = simpool.empty((8, 2), "float16", stream=P)
    cap = _core._export_simulated(buf.view(), stream=-1, max_version=(1, 0))
    t = managed(cap).contents
    assert (t.dl_tensor.device.device_type, t.dl_tensor.device.device_id) == (2, 0)
    assert dims(managed(cap)) == ((8, 2), (2, 1))
    del cap                                   # unconsumed: its destructor frees the block
    gc.collect()
    assert simpool.used_bytes() > 0           # `buf` still holds its own reference
    del buf
    gc.collect()
    assert simpool.used_bytes() == 0


def test_record_stream_for_array_interface_consumers(simpool):
    dev = simpool.device
    buf = simpool.empty(1 << 20, "uint8", stream=P)
    ptr = buf.ptr
    buf.record_stream(C)
    dev.launch(C)
    del buf
    gc.collect()
    assert simpool.alloc(1 << 20, stream=P) != ptr
    dev.complete(C)
    with pytest.raises(TypeError, match="stream"):
        simpool.empty(4).record_stream("C")


def test_export_simulated_is_for_sim_only(pool):
    with pytest.raises(ValueError, match="sim"):
        _core._export_simulated(pool.empty(4))
