"""The cudaMemPool a Pool shares with other processes (Note [Sharing CUDA memory],
mempool/_csrc/upstream/mp_cuda_share.c): created with the POSIX file-descriptor handle type
where the device offers it (mempool/_cuda.py), through a fake of CuPy's runtime bindings. The
sharing itself is tested on the fake driver (test_cuda_share_fake.py) and on the GPU
(tests/gpu/test_gpu_ipc.py)."""
import pytest

from mempool import _cuda


class _Runtime:
    """CuPy's runtime bindings as resolve_pool_handle and shareable_supported use them."""
    cudaMemAllocationTypePinned = 1
    cudaMemHandleTypeNone = 0
    cudaMemLocationTypeDevice = 1

    def __init__(self, handle_types=(0x1, 0x0)):
        self.handle_types = handle_types   # per device
        self.calls = []

    @staticmethod
    def MemPoolProps(*args):
        return args

    def getDeviceCount(self):
        return len(self.handle_types)

    def deviceGetAttribute(self, attr, device):
        self.calls.append(("deviceGetAttribute", attr, device))
        return self.handle_types[device]

    def memPoolCreate(self, props):
        self.calls.append(("memPoolCreate", props))
        return 0x5000

    def deviceGetDefaultMemPool(self, device):
        self.calls.append(("deviceGetDefaultMemPool", device))
        return 0x6000


@pytest.fixture
def rt(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(_cuda, "_runtime", lambda: runtime)
    return runtime


def test_a_device_shares_where_its_pools_take_posix_descriptors(rt):
    assert _cuda.shareable_supported(0) is True
    assert _cuda.shareable_supported(1) is False
    assert rt.calls == [("deviceGetAttribute", 119, 0), ("deviceGetAttribute", 119, 1)]
    rt.handle_types = (0x1 | 0x8, 0x8)      # with the fabric handle too; fabric alone
    assert _cuda.shareable_supported(0) is True
    assert _cuda.shareable_supported(1) is False


def test_a_shareable_pool_is_created_with_the_posix_descriptor_type(rt):
    assert _cuda.resolve_pool_handle("create", 0, shareable=True) == (0x5000, True)
    assert _cuda.resolve_pool_handle("create", 0) == (0x5000, True)
    creates = [c[1] for c in rt.calls if c[0] == "memPoolCreate"]
    assert creates == [(1, 0x1, 1, 0), (1, 0x0, 1, 0)]   # shareable, then not


def test_a_device_that_cannot_share_refuses_before_creating(rt):
    with pytest.raises(ValueError, match="device 1 cannot create a cudaMemPool shared"):
        _cuda.resolve_pool_handle("create", 1, shareable=True)
    assert not [c for c in rt.calls if c[0] == "memPoolCreate"]


@pytest.mark.parametrize("pool_handle", ["default", "current", 0x7000])
def test_only_a_created_pool_can_be_shareable(rt, pool_handle):
    with pytest.raises(ValueError, match="pool_handle='create'.*ipc=True") as info:
        _cuda.resolve_pool_handle(pool_handle, 0, shareable=True)
    assert repr(pool_handle) in str(info.value)
    assert rt.calls == []
    assert _cuda.resolve_pool_handle("default", 0) == (0x6000, False)   # unshared: as before


@pytest.mark.parametrize("shareable", ["yes", 1, None])
def test_shareable_must_be_a_bool(rt, shareable):
    with pytest.raises(TypeError, match="shareable must be a bool"):
        _cuda.resolve_pool_handle("create", 0, shareable=shareable)
    assert rt.calls == []


@pytest.mark.parametrize("device,error", [(2, ValueError), (-1, ValueError), ("0", TypeError)])
def test_a_bad_device_is_refused_before_any_call(rt, device, error):
    with pytest.raises(error, match="device"):
        _cuda.shareable_supported(device)
    assert rt.calls == []
