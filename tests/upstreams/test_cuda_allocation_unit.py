"""The rounding a Pool on backend="cuda" takes by default: the unit its cudaMemPool backs
allocations with (Note [The cudaMemPool's unit], mempool/_cuda.py), measured through a fake
of CuPy's runtime bindings; the GPU test that the device then holds what the pool reserves
is in tests/gpu/test_gpu_cudapool.py, the rounding itself in tests/core/test_segment_rounding.py."""
import pytest

from mempool import _cuda

MiB = 1 << 20


class _Runtime:
    """CuPy's runtime bindings as allocation_unit() uses them: a cudaMemPool whose chunk is
    `unit`, every call recorded."""
    cudaMemPoolAttrReservedMemCurrent = 5

    def __init__(self, unit=32 * MiB, fail_alloc=False, devices=2):
        self.unit, self.fail_alloc, self.devices = unit, fail_alloc, devices
        self.calls = []
        self.reserved = 0
        self.current = 0

    cudaMemAllocationTypePinned = cudaMemHandleTypeNone = cudaMemLocationTypeDevice = 0

    @staticmethod
    def MemPoolProps(*args):
        return ("props",) + args

    def getDeviceCount(self):
        return self.devices

    def getDevice(self):
        return self.current

    def setDevice(self, device):
        self.calls.append(("setDevice", device))
        self.current = device

    def memPoolCreate(self, props):
        self.calls.append(("memPoolCreate", props[-1]))
        return 0x5000

    def memPoolDestroy(self, handle):
        self.calls.append(("memPoolDestroy", handle))

    def streamCreateWithFlags(self, flags):
        self.calls.append(("streamCreateWithFlags", flags))
        return 0x7000

    def streamDestroy(self, stream):
        self.calls.append(("streamDestroy", stream))

    def mallocFromPoolAsync(self, nbytes, handle, stream):
        self.calls.append(("mallocFromPoolAsync", nbytes, handle, stream))
        if self.fail_alloc:
            raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
        self.reserved = self.unit
        return 0x9000

    def memPoolGetAttribute(self, handle, attr):
        assert attr == self.cudaMemPoolAttrReservedMemCurrent
        return self.reserved

    def freeAsync(self, ptr, stream):
        self.calls.append(("freeAsync", ptr, stream))

    # Names a probe must never call: each would break a capture on another stream.
    def streamSynchronize(self, stream):
        raise AssertionError("the probe synchronized a stream")

    def deviceSynchronize(self):
        raise AssertionError("the probe synchronized the device")


@pytest.fixture
def runtime(monkeypatch):
    def make(**kwargs):
        rt = _Runtime(**kwargs)
        monkeypatch.setattr(_cuda, "_runtime", lambda: rt)
        monkeypatch.setattr(_cuda, "_units", {})
        return rt
    return make


@pytest.mark.parametrize("unit,rounding", [
    (32 * MiB, 32 * MiB),
    (64 * MiB, 64 * MiB),
    (1 << 30, 1 << 30),
    (2 * MiB, None),            # PyTorch's plain segments already are whole units
    (3 * MiB, None),            # not a size the core rounds to
    (2 << 30, None),            # beyond any sensible segment
    (0, None),
    (None, None),               # the probe could not allocate
    (True, None),
])
def test_the_rounding_is_the_unit_where_the_core_can_round_to_it(unit, rounding):
    assert _cuda.segment_rounding_for(unit) == rounding


def test_the_unit_is_what_the_driver_holds_for_one_byte(runtime):
    rt = runtime(unit=32 * MiB)
    rt.current = 1
    assert _cuda.allocation_unit(0) == 32 * MiB
    names = [c[0] for c in rt.calls]
    assert names == ["memPoolCreate", "setDevice", "streamCreateWithFlags",
                     "mallocFromPoolAsync", "freeAsync", "streamDestroy", "setDevice",
                     "memPoolDestroy"]
    assert ("mallocFromPoolAsync", 1, 0x5000, 0x7000) in rt.calls
    assert rt.current == 1, "the probe left another device current"


def test_the_unit_is_measured_once_per_device(runtime):
    rt = runtime(unit=32 * MiB)
    assert _cuda.allocation_unit(0) == 32 * MiB
    assert _cuda.allocation_unit(0) == 32 * MiB
    rt.unit = 64 * MiB
    assert _cuda.allocation_unit(1) == 64 * MiB
    assert [c[0] for c in rt.calls].count("mallocFromPoolAsync") == 2


def test_a_full_device_gives_no_unit_and_is_asked_again(runtime):
    rt = runtime(fail_alloc=True)
    rt.current = 1
    assert _cuda.allocation_unit(0) is None
    names = [c[0] for c in rt.calls]
    assert names[-3:] == ["streamDestroy", "setDevice", "memPoolDestroy"]
    assert rt.current == 1
    rt.fail_alloc = False
    assert _cuda.allocation_unit(0) == 32 * MiB


@pytest.mark.parametrize("device,error", [(2, ValueError), (-1, ValueError),
                                          ("0", TypeError), (True, TypeError)])
def test_a_bad_device_is_refused_before_any_call(runtime, device, error):
    rt = runtime()
    with pytest.raises(error, match="device"):
        _cuda.allocation_unit(device)
    assert rt.calls == []
