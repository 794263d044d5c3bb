"""Note [Current stream]: CuPy's current stream is looked up through its Python API only when
the handle CuPy's C layer keeps has changed since the last lookup. Exercised here with a
stand-in for CuPy's exported C function (a ctypes callback in a capsule of the same
signature) and for its Python API."""
import ctypes

import pytest

from mempool._core import _CurrentStream

SIGNATURE = b"intptr_t (int)"
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Stream:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeCupy:
    """CuPy's current stream per device, readable both ways, as CuPy keeps it."""

    def __init__(self, signature=SIGNATURE, skew=0):
        self.current = {0: 0x1000, 1: 0x2000}
        self.slow_calls = []
        self.fast_calls = []
        self.skew = skew   # a C layer that disagrees with the Python API by this much

        def fast(device):
            self.fast_calls.append(device)
            return self.current[device] + self.skew

        self._callback = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(fast)
        self._name = ctypes.create_string_buffer(signature)   # the capsule keeps the pointer
        self.capi = {"get_stream_ptr": _new_capsule(ctypes.cast(self._callback, ctypes.c_void_p),
                                                     self._name, None)}

    def get_current_stream(self, device):
        self.slow_calls.append(device)
        return Stream(self.current[device])


def make(cupy, device=0):
    lookup = _CurrentStream(cupy.get_current_stream, cupy.capi, device)
    cupy.slow_calls.clear()
    return lookup


def test_an_unchanged_stream_is_not_looked_up_again():
    cupy = FakeCupy()
    lookup = make(cupy)
    assert lookup.fast
    handle, stream = lookup.lookup(0)
    assert handle == 0x1000 and stream.ptr == 0x1000       # looked up: the caller pins it
    for _ in range(5):
        assert lookup.lookup(0) == (0x1000, None)          # known: no Python call
    assert cupy.slow_calls == [0] and lookup.slow_lookups == 1
    assert len(cupy.fast_calls) >= 6


def test_a_changed_stream_is_looked_up():
    cupy = FakeCupy()
    lookup = make(cupy)
    lookup.lookup(0)
    cupy.current[0] = 0x3000                               # `with other_stream:` in CuPy
    handle, stream = lookup.lookup(0)
    assert handle == 0x3000 and stream.ptr == 0x3000
    assert lookup.lookup(0) == (0x3000, None)
    cupy.current[0] = 0x1000                               # back to the first
    assert lookup.lookup(0)[0] == 0x1000
    assert cupy.slow_calls == [0, 0, 0]


def test_the_device_asked_for_is_the_one_read():
    cupy = FakeCupy()
    lookup = make(cupy, device=1)
    assert lookup.lookup(1)[0] == 0x2000
    assert cupy.fast_calls[-1] == 1 and cupy.slow_calls == [1]


def test_forget_makes_the_next_lookup_ask_again():
    cupy = FakeCupy()
    lookup = make(cupy)
    lookup.lookup(0)
    lookup.forget()
    handle, stream = lookup.lookup(0)
    assert handle == 0x1000 and stream is not None and cupy.slow_calls == [0, 0]


@pytest.mark.parametrize("cupy", [FakeCupy(skew=1), FakeCupy(signature=b"intptr_t (void)")],
                         ids=["disagrees", "other-signature"])
def test_a_c_layer_not_as_expected_is_not_used(cupy):
    lookup = make(cupy)
    assert not lookup.fast
    for _ in range(3):
        handle, stream = lookup.lookup(0)
        assert handle == 0x1000 and stream.ptr == 0x1000
    assert cupy.slow_calls == [0, 0, 0]


def test_without_a_c_layer_every_lookup_asks_python():
    cupy = FakeCupy()
    lookup = _CurrentStream(cupy.get_current_stream, None, 0)
    assert not lookup.fast
    assert [lookup.lookup(0)[0] for _ in range(2)] == [0x1000, 0x1000]
    assert cupy.slow_calls == [0, 0]
