"""No Python call may crash, corrupt or silently misconfigure the process.

One test per defect found by trying the Python surface as an attacker would. Calls that used
to kill the process (a segfault) run in a child process, so that a regression is a failed
test naming the call rather than a dead test run. The crash-seeking fuzzer of the whole
surface is tests/project/test_fuzz_surface.py; docs/reliability.md lists what is tested and how.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import mempool
from mempool import _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def run_cases(cases, setup="import mempool\nfrom mempool import _core\n"):
    """Run each expression of `cases` in one child process; return {expr: (exception type
    name, message)} ("ok" for none). A crash fails with the case it died on: every case's
    line is flushed before the next one runs."""
    code = setup + textwrap.dedent("""
        import sys
        for _expr in sys.argv[1:]:
            try:
                eval(_expr)
            except Exception as _e:
                print(repr(_expr), type(_e).__name__, str(_e).replace("\\n", " "), sep="\\t",
                      flush=True)
            else:
                print(repr(_expr), "ok", "", sep="\\t", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code, *cases], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    seen = {}
    for line in proc.stdout.splitlines():
        expr, kind, message = line.split("\t", 2)
        seen[eval(expr)] = (kind, message)
    if proc.returncode != 0:
        died_on = next((c for c in cases if c not in seen), "?")
        pytest.fail(f"the child died with code {proc.returncode} (negative: signal) on "
                    f"{died_on!r}\n{proc.stderr[-3000:]}")
    return seen


# ---- short tuples to __dlpack__ (a global boundscheck=False read past the tuple) --------------

@pytest.mark.parametrize("kwargs", ["max_version=(1,)", "max_version=()", "dl_device=(1,)",
                                    "dl_device=()", "max_version=(1, 0, 0)",
                                    "dl_device=(1, 0, 0)", "max_version=[1]",
                                    "max_version={0: 1}", "dl_device='ab'"])
def test_short_or_odd_dlpack_tuples_are_a_type_error(kwargs):
    expr = f"mempool.Pool(backend='host').empty((16,), 'f4').__dlpack__({kwargs})"
    kind, message = run_cases([expr])[expr]
    assert kind == "TypeError", (kind, message)
    assert kwargs.split("=")[0] in message and "pair of ints" in message


# ---- objects never initialised --------------------------------------------------------------

UNINITIALISED = [
    "_core._torch_track_private(0, mempool.Pool.__new__(mempool.Pool))",
    "mempool.Pool.__new__(mempool.Pool).alloc(16)",
    "mempool.Pool.__new__(mempool.Pool).free(16)",
    "mempool.Pool.__new__(mempool.Pool).stats()",
    "mempool.Pool.__new__(mempool.Pool).layout()",
    "mempool.Pool.__new__(mempool.Pool).empty(4)",
    "mempool.Pool.__new__(mempool.Pool).malloc(16)",
    "mempool.Pool.__new__(mempool.Pool).record_stream(16, 5)",
    "mempool.Pool.__new__(mempool.Pool).forget_stream(5)",
    "mempool.Pool.__new__(mempool.Pool).set_limit(5)",
    "mempool.Pool.__new__(mempool.Pool).set_size_policy(max_split_size=None)",
    "mempool.Pool.__new__(mempool.Pool).check_invariants()",
    "mempool.Pool.__new__(mempool.Pool).enable_peer_access(1)",
    "mempool.Pool.__new__(mempool.Pool).access_devices(16)",
    "mempool.Pool.__new__(mempool.Pool).history()",
    "Sub().alloc(16)",
    "Sub().used_bytes()",
    "mempool.SimDevice.__new__(mempool.SimDevice).launch(1)",
    "mempool.SimDevice.__new__(mempool.SimDevice).counters()",
    "mempool.SimDevice.__new__(mempool.SimDevice).fail_next(1)",
    "mempool.SimDevice.__new__(mempool.SimDevice).hold_allocs(1)",
    "mempool.HostDevice.__new__(mempool.HostDevice).capacity",
    "mempool.HostDevice.__new__(mempool.HostDevice).counters()",
    "mempool.HostDevice.__new__(mempool.HostDevice).launch(1)",
    "type(mempool.Pool(backend='sim').device).__mro__[1].__new__("
    "type(mempool.Pool(backend='sim').device).__mro__[1]).capacity",
    "mempool.Buffer.__new__(mempool.Buffer).ndim",
    "mempool.Buffer.__new__(mempool.Buffer).nbytes",
    "mempool.Buffer.__new__(mempool.Buffer).view()",
    "mempool.Buffer.__new__(mempool.Buffer).__dlpack__()",
    "mempool.Buffer.__new__(mempool.Buffer).__dlpack_device__()",
    "mempool.Buffer.__new__(mempool.Buffer).record_stream(0)",
    "mempool.Buffer.__new__(mempool.Buffer).__array_interface__",
    "_core._export_simulated(mempool.Buffer.__new__(mempool.Buffer))",
    "_core.bench_core_roundtrips(mempool.Pool.__new__(mempool.Pool), 512, 1)",
    "_core._capture_begin(mempool.Pool.__new__(mempool.Pool))",
    "_core._capture_end(mempool.Pool.__new__(mempool.Pool))",
    "mempool.SimDevice.__new__(mempool.SimDevice).begin_capture(5)",
    "mempool.SimDevice.__new__(mempool.SimDevice).capture_violations",
    "mempool.SimDevice.__new__(mempool.SimDevice).destroy_stream(5)",
    "mempool.SimDevice.__new__(mempool.SimDevice).fail_events(1)",
    "mempool.SimDevice.__new__(mempool.SimDevice).hold_syncs(1)",
    "mempool.SimDevice.__new__(mempool.SimDevice).hold_event_creates(1)",
    "mempool.SimDevice.__new__(mempool.SimDevice).hold_va_reserves(1)",
]


def test_methods_of_objects_never_initialised_raise():
    seen = run_cases(UNINITIALISED, setup=textwrap.dedent("""
        import mempool
        from mempool import _core

        class Sub(mempool.Pool):
            def __init__(self):       # forgets super().__init__()
                pass
    """))
    for expr in UNINITIALISED:
        kind, message = seen[expr]
        assert kind == "RuntimeError" and "never initialised" in message, (expr, kind, message)


def test_reprs_of_uninitialised_objects_say_so():
    assert repr(mempool.Pool.__new__(mempool.Pool)) == "<mempool.Pool uninitialised>"
    assert repr(mempool.Buffer.__new__(mempool.Buffer)) == "<mempool.Buffer uninitialised>"


@pytest.mark.parametrize("cls", [mempool.SimDevice, mempool.HostDevice, mempool.Buffer])
def test_device_and_buffer_constructors_point_to_their_maker(cls):
    with pytest.raises(TypeError, match="made by"):
        cls()


# ---- module functions given None for a typed argument -----------------------------------------

NONE_ARGS = [
    "_core._torch_register(0, None)",
    "_core._torch_track_private(0, None)",
    "_core._torch_release_private(None)",
    "_core._torch_follow_size_policy(None)",
    "_core._export_simulated(None)",
]


def test_none_for_a_pool_or_buffer_argument_is_a_type_error():
    seen = run_cases(NONE_ARGS)
    for expr in NONE_ARGS:
        kind, message = seen[expr]
        assert kind == "TypeError" and "None" in message, (expr, kind, message)


def test_raw_addresses_that_would_be_called_or_dereferenced_are_refused():
    cases = ["_core.bench_fn_roundtrips(0x1234, 0x5678, 512, 1)",
             "_core._torch_alloc_at(0x1234, 512)",
             "_core._torch_alloc_at(-1, 512)",
             "_core._torch_alloc_at(_core._torch_pool_address(0) or 8, -5)"]
    seen = run_cases(cases)
    for expr in cases:
        kind, message = seen[expr]
        assert kind in ("ValueError", "TypeError"), (expr, kind, message)


# ---- Pool.__init__ twice ----------------------------------------------------------------------

def test_a_second_init_is_refused_and_changes_nothing():
    pool = mempool.Pool(backend="sim", capacity="4GB")
    ptr = pool.alloc(50 * MiB)
    device, options = pool.device, dict(pool.options)
    reserved = pool.reserved_bytes()
    for kwargs in ({"backend": "host"}, {"backend": "sim", "capacity": "1GB"},
                   {"backend": "bogus"}):
        with pytest.raises(RuntimeError, match="already initialised"):
            pool.__init__(**kwargs)
    assert pool.device is device
    assert pool.backend == "sim" and pool.options == options
    assert pool.reserved_bytes() == reserved and pool.device.used_bytes == reserved
    pool.free(ptr)
    pool.check_invariants()


def test_re_init_no_longer_leaks_the_c_pool():
    # 20 re-inits with a live 50 MiB block of host memory grew RSS by 1 GB: each one
    # dropped the C pool without releasing it. Now each is refused; the one device stays.
    pool = mempool.Pool(backend="host", capacity="256MB")
    pool.alloc(50 * MiB)
    for _ in range(20):
        with pytest.raises(RuntimeError):
            pool.__init__(backend="host", capacity="256MB")
    assert pool.device.used_bytes == pool.reserved_bytes() <= 64 * MiB


def test_a_failed_first_init_leaves_an_uninitialised_pool_that_can_init_again():
    pool = mempool.Pool.__new__(mempool.Pool)
    with pytest.raises(ValueError, match="granularity"):
        pool.__init__(backend="sim", granularity=1000)          # refused by the device
    assert pool.backend is None and pool.options is None and pool.device is None
    with pytest.raises(RuntimeError, match="never initialised"):
        pool.alloc(512)
    pool.__init__(backend="sim", capacity="1GB")
    assert pool.backend == "sim" and pool.capacity == 1 << 30
    pool.free(pool.alloc(512))
    pool.check_invariants()


# ---- option values out of range -------------------------------------------------------------

BIG = 2 ** 64


@pytest.mark.parametrize("call, option", [
    ("mempool.Pool(backend='sim', capacity=BIG)", "capacity"),
    ("mempool.Pool(backend='sim', limit=BIG)", "limit"),
    ("mempool.Pool(backend='sim', release_threshold=BIG)", "release_threshold"),
    ("mempool.Pool(backend='sim', initial_pool_size=BIG)", "initial_pool_size"),
    ("mempool.Pool(backend='sim', granularity=BIG)", "granularity"),
    ("mempool.Pool(backend='sim', max_split_size=BIG)", "max_split_size"),
    ("mempool.Pool(backend='sim', device=2 ** 40)", "device"),
    ("mempool.Pool(backend='sim', roundup_power2_divisions=2 ** 60)", "roundup_power2_divisions"),
    ("mempool.Pool.from_conf('backend:sim,max_split_size_mb:99999999999999999999')",
     "max_split_size_mb"),
    ("mempool.Pool.from_conf('backend:sim,capacity:99999999999999999999TB')", "capacity"),
    ("mempool.Pool(backend='sim').set_limit(BIG)", "limit"),
    ("mempool.Pool(backend='sim').set_release_threshold(BIG)", "release_threshold"),
    ("mempool.Pool(backend='sim').set_size_policy(max_split_size=BIG)", "max_split_size"),
    ("mempool.Pool(backend='sim').set_size_policy(roundup_power2_divisions=2 ** 60)",
     "roundup_power2_divisions"),
    ("mempool.Pool(backend='sim').trim(BIG)", "keep"),
    ("mempool.round_size(BIG)", "nbytes"),
    ("mempool.Pool(backend='sim', initial_pool_size=2 ** 64 - 1)", "initial_pool_size"),
    ("mempool.Pool(backend='host', initial_pool_size=2 ** 62 + 1, expandable_segments=True)",
     "initial_pool_size"),
    ("mempool.round_size(2 ** 21 + 1, 2 ** 60)", "roundup_power2_divisions"),
    ("mempool.Pool(backend='sim').device.ordered(0, 0, -1)", "seq"),
    ("mempool.Pool(backend='sim').device.ordered(0, 0, BIG)", "seq"),
])
def test_out_of_range_values_name_the_option_and_range(call, option):
    with pytest.raises(ValueError) as err:
        eval(call)
    assert not isinstance(err.value, OverflowError)
    message = str(err.value)
    assert option in message, message
    assert any(w in message for w in ("2**", "range", "at most", ">= 0")), message


def test_an_initial_pool_size_that_wrapped_to_nothing_is_refused():
    # initial_pool_size=2**64-1 made a pool with nothing reserved: the core's rounding up to
    # a segment wrapped round to 0.
    with pytest.raises(ValueError, match="initial_pool_size"):
        mempool.Pool(backend="sim", initial_pool_size=2 ** 64 - 1)
    with pytest.raises(mempool.OutOfMemoryError):
        mempool.Pool(backend="sim", initial_pool_size=2 ** 62)   # refused, not wrapped


def test_a_page_larger_than_the_device_is_refused():
    # Every allocation was an out-of-memory error, with no word of why.
    with pytest.raises(ValueError, match="'granularity'.*exceeds 'capacity'"):
        mempool.Pool(backend="sim", capacity="1GB", granularity="2GB", expandable_segments=True)
    pool = mempool.Pool(backend="sim", capacity="1GB", granularity="1GB",
                        expandable_segments=True)
    pool.free(pool.alloc(512))


def test_the_largest_size_no_longer_means_unlimited():
    # set_limit(2**64 - 1) was silently "no limit" (the core's sentinel): None says that.
    pool = mempool.Pool(backend="sim")
    for option in ("set_limit", "set_release_threshold"):
        with pytest.raises(ValueError, match="write None for no limit"):
            getattr(pool, option)(2 ** 64 - 1)
    assert pool.options["limit"] is None and pool.options["release_threshold"] is None
    pool.set_limit(2 ** 64 - 2)                 # the largest limit that is a limit
    assert pool.options["limit"] == 2 ** 64 - 2
    pool.set_limit(None)
    assert pool.options["limit"] is None


@pytest.mark.parametrize("how", ["conf", "keyword", "set_limit"])
def test_a_fraction_that_leaves_no_byte_is_refused(how):
    # per_process_memory_fraction:1e-300 made a pool with a 0-byte limit.
    with pytest.raises(ValueError, match="less than one byte"):
        if how == "conf":
            mempool.Pool.from_conf("backend:sim,per_process_memory_fraction:1e-300")
        elif how == "keyword":
            mempool.Pool(backend="sim", limit=1e-300)
        else:
            pool = mempool.Pool(backend="sim", limit="1GB")
            try:
                pool.set_limit(1e-300)
            finally:
                assert pool.options["limit"] == 1 << 30, "a refused set_limit changes nothing"


@pytest.mark.parametrize("conf", ["backend:sim,device:１", "backend:sim,capacity:１GB",
                                  "backend:sim,max_split_size_mb:２０",
                                  "backend:sim,garbage_collection_threshold:０.5",
                                  "backend:sim,per_process_memory_fraction:０.5",
                                  "backend:sim,limit:０.5",
                                  "backend:sim,roundup_power2_divisions:[２:1]"])
def test_non_ascii_digits_are_refused(conf):
    with pytest.raises(ValueError, match="is not valid"):
        mempool.Pool.from_conf(conf)


def test_device_keyword_refuses_non_ascii_digits_too():
    with pytest.raises(ValueError, match="'device'"):
        mempool.Pool(backend="sim", device="１")
    assert mempool.Pool(backend="sim", device="1").device_id == 1


# ---- stream objects -------------------------------------------------------------------------

class _Proto:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        return self.value


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.mark.parametrize("stream, error, words", [
    (_Proto((0, "x")), TypeError, "__cuda_stream__"),
    (_Proto((0, 1.5)), TypeError, "__cuda_stream__"),
    (_Proto((0, -1)), ValueError, "[0, 2**64)"),
    (_Proto((0, BIG)), ValueError, "[0, 2**64)"),
    (_Proto((0,)), TypeError, "(version, handle)"),
    (_Ptr(1.5), TypeError, "stream.ptr"),         # was truncated to 1 by int()
    (_Ptr("7"), TypeError, "stream.ptr"),         # was parsed as 7 by int()
    (_Ptr(BIG), ValueError, "stream.ptr"),
])
def test_bad_stream_objects_get_a_clear_error(stream, error, words):
    pool = mempool.Pool(backend="sim")
    with pytest.raises(error) as err:
        pool.alloc(512, stream=stream)
    assert words in str(err.value)
    assert pool.used_bytes() == 0 and pool.pinned_streams == {}


def test_a_buffer_is_not_taken_for_a_stream():
    # Found by the fuzzer: a Buffer has .ptr, as CuPy streams do, so alloc(n, stream=buf)
    # pinned the Buffer and kept its memory until forget_stream.
    pool = mempool.Pool(backend="host")
    buf = pool.empty(16)
    with pytest.raises(TypeError, match="mempool.Buffer"):
        pool.alloc(512, stream=buf)
    assert pool.pinned_streams == {}
    del buf
    assert pool.used_bytes() == 0


def test_a_good_stream_object_still_works():
    pool = mempool.Pool(backend="sim")
    ptr = pool.alloc(512, stream=_Proto((0, 77)))
    assert pool.block_info(ptr)[2] == 77
    ptr2 = pool.alloc(512, stream=_Ptr(78))
    assert pool.block_info(ptr2)[2] == 78
    pool.free(ptr)
    pool.free(ptr2)


# ---- shapes and DLPack stream values --------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 2 ** 63), (2 ** 63,), (0, 2 ** 40, 2 ** 40), 2 ** 64])
def test_shapes_beyond_int64_are_refused_up_front(shape):
    pool = mempool.Pool(backend="host")
    with pytest.raises(ValueError, match="shape"):
        pool.empty(shape, "uint8")
    assert pool.used_bytes() == 0


def test_the_largest_empty_shape_exports():
    numpy = pytest.importorskip("numpy")
    pool = mempool.Pool(backend="host")
    buf = pool.empty((0, 2 ** 62), "uint8")
    assert numpy.from_dlpack(buf).shape == (0, 2 ** 62)


@pytest.mark.parametrize("stream", [BIG, 2 ** 70])
def test_a_dlpack_stream_beyond_a_handle_is_a_buffer_error(stream):
    pool = mempool.Pool(backend="sim")
    buf = pool.empty(16)
    with pytest.raises(BufferError, match="2\\*\\*64"):
        _core._export_simulated(buf, stream=stream, max_version=(1, 0))
    assert not buf.exported


def test_a_bool_dlpack_stream_is_a_type_error():
    pool = mempool.Pool(backend="sim")
    with pytest.raises(TypeError, match="stream"):
        _core._export_simulated(pool.empty(16), stream=True)


# ---- messages ---------------------------------------------------------------------------------

def test_too_many_recorded_streams_says_the_limit():
    # Reaching the limit takes 32768 streams (tens of kilobytes of bookkeeping each), too
    # much for the test tier: the message built from the core's code is checked instead.
    message = str(_core._pointer_error(_core._MP_EINVAL, "record_stream", 0x1000))
    assert "too many streams recorded" in message and "32768" in message


# ---- the C checks (mempool/_csrc/core/mp_assert.h) -------------------------------------------------

def test_a_deleter_called_twice_aborts_with_a_message_instead_of_freeing_twice():
    # A consumer bug: the always-on check (mp_check) stops it before the block is released
    # a second time, which would free memory another holder still uses.
    code = textwrap.dedent("""
        import ctypes, mempool
        api = ctypes.pythonapi
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
        pool = mempool.Pool(backend="host")
        buf = pool.empty(16)
        keep = buf.view()                    # another holder whose memory must stay
        for versioned in (False, True):
            name = b"dltensor_versioned" if versioned else b"dltensor"
            cap = buf.__dlpack__(max_version=(1, 0) if versioned else None)
            ptr = api.PyCapsule_GetPointer(cap, name)
            api.PyCapsule_SetName(cap, b"used_" + name)
            # deleter's offset: versioned (version 8, manager_ctx 8) = 16; legacy: after
            # DLTensor (48 bytes) and manager_ctx (8) = 56
            off = 16 if versioned else 56
            deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
                ctypes.c_void_p.from_address(ptr + off).value)
            deleter(ptr)
            if versioned:
                print("second call", flush=True)
                deleter(ptr)
                print("survived", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert "second call" in proc.stdout and "survived" not in proc.stdout
    assert proc.returncode == -6, proc.stderr     # SIGABRT from the check, not a SIGSEGV
    assert "mempool: check failed" in proc.stderr and "mp_dlpack.c" in proc.stderr


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")
@pytest.mark.parametrize("debug", [0, 1])
def test_assert_grades(tmp_path, debug):
    # mp_check always aborts; mp_assert and mp_assert_expensive only in the debug build,
    # and there their condition must not even be evaluated in a release build.
    src = tmp_path / "grades.c"
    src.write_text(textwrap.dedent("""
        #include <stdio.h>
        #include <string.h>
        #include "mp_assert.h"
        static int evaluated;
        static int touch(void) { evaluated = 1; return 0; }
        int main(int argc, char **argv) {
            if (!strcmp(argv[1], "check")) mp_check(argc < 0);
            if (!strcmp(argv[1], "assert")) mp_assert(touch());
            if (!strcmp(argv[1], "expensive")) mp_assert_expensive(touch());
            printf("survived evaluated=%d debug=%d\\n", evaluated, MP_DEBUG);
            return 0;
        }
    """))
    exe = tmp_path / "grades"
    flags = [f"-DMP_DEBUG={debug}"] if debug else []
    subprocess.run([os.environ.get("CC", "cc"), "-std=gnu11", "-Wall", "-Werror", "-Wno-unused-function", *flags,
                    "-I", os.path.join(ROOT, "mempool", "_csrc", "common"), str(src), "-o", str(exe)],
                   check=True)
    for grade in ("check", "assert", "expensive"):
        proc = subprocess.run([str(exe), grade], capture_output=True, text=True, timeout=30)
        if grade == "check" or debug:
            assert proc.returncode == -6, (grade, proc.stdout, proc.stderr)
            words = {"check": "check", "assert": "assert", "expensive": "expensive assert"}
            assert f"mempool: {words[grade]} failed" in proc.stderr
            assert "grades.c" in proc.stderr
        else:
            assert proc.returncode == 0 and "survived evaluated=0 debug=0" in proc.stdout


def test_debug_build_flag_matches_the_build():
    # CI's debug stage sets MEMPOOL_EXPECT_DEBUG=1 so that a stage that silently ran the
    # release extension fails here.
    expected = os.environ.get("MEMPOOL_EXPECT_DEBUG")
    if expected is None:
        pytest.skip("MEMPOOL_EXPECT_DEBUG is not set (CI's debug stage sets it)")
    assert _core.DEBUG_BUILD == (expected == "1"), _core.__file__


# ---- refused calls change nothing (found by the fuzzer) ---------------------------------------

class _Stream:
    """A stream object the pool pins (Note [Pinned streams])."""

    def __init__(self, handle):
        self.ptr = handle


@pytest.mark.parametrize("call", ["record_stream", "free", "empty"])
def test_a_refused_call_does_not_pin_its_stream(call):
    # record_stream(bad pointer, stream) used to keep the stream object alive until
    # forget_stream, though the call was refused.
    pool = mempool.Pool(backend="sim")
    keep = pool.alloc(512, stream=_Stream(5))
    pinned = dict(pool.pinned_streams)
    with pytest.raises(ValueError):
        if call == "record_stream":
            pool.record_stream(0x1234, _Stream(6))
        elif call == "free":
            pool.free(0x1234, stream=_Stream(6))
        else:
            pool.empty((1 << 40, 1 << 40), "float64", stream=_Stream(6))
    assert pool.pinned_streams == pinned
    pool.record_stream(keep, _Stream(6))             # an accepted call still pins
    assert sorted(pool.pinned_streams) == [5, 6]
    pool.free(keep)


# ---- helpers of mempool.torch / cupy / jax -------------------------------------------------------

@pytest.mark.parametrize("call", [
    "mempool.jax.check_importable(None)",
    "mempool.jax.from_buffer(5)",
    "mempool.jax.from_pool(None, 4)",
    "mempool.cupy.set_allocator(5)",
    "mempool.cupy.from_pool('pool', 4)",
    "mempool.torch.from_pool(None, 4)",
])
def test_support_name_a_wrong_argument(call):
    # They raised AttributeError ("'NoneType' object has no attribute 'backend'") from deep
    # inside; now a TypeError naming the argument, before any framework is imported.
    import mempool.cupy
    import mempool.jax
    import mempool.torch
    with pytest.raises(TypeError, match=r"^(pool|buf): expected a mempool\.(Pool|Buffer)"):
        eval(call)


def test_an_index_that_refuses_is_named_with_the_argument():
    """A NumPy array of several elements has an __index__ that raises NumPy's own message;
    the pool says which argument it was and what it accepts, and changes nothing."""
    np = pytest.importorskip("numpy")
    pool = mempool.Pool(backend="sim")
    before = pool.stats()
    with pytest.raises(TypeError, match=r"nbytes must be an integer number of bytes, got "
                                        r"ndarray .* whose __index__ refused"):
        pool.alloc(np.array([4096, 1]))
    with pytest.raises(TypeError, match=r"ptr must be an integer address, got ndarray"):
        pool.free(np.array([4096, 1]))
    class Refusing:
        def __index__(self):
            raise TypeError("no index here")

    with pytest.raises(TypeError, match=r"stream must be an int stream handle, got Refusing "
                                        r".* whose __index__ refused: no index here"):
        pool.alloc(512, stream=Refusing())
    assert pool.stats() == before
    pool.check_invariants()
