"""The table's share, share_open and share_close (mp_torch.h; Note [Sharing across processes],
core/mp_share.c), on `sim`, with ctypes playing the glue: what shareIpcHandle and getIpcDevPtr
(glue/torch_ipc.cpp) ask of the core, routed by device. The glue's handling of PyTorch's
handles runs on the GPU (tests/gpu/test_gpu_torch_ipc.py)."""
import ctypes

import pytest

import mempool
from mempool import _core
from test_torch_api_table import DEVICE, MP_EINVAL, MP_OK, MiB, sz, u
from test_torch_api_table import api, routed  # noqa: F401  (fixtures)

MP_ENOTFOUND = 4
MP_EDOUBLEFREE = 6
CONSUMER = DEVICE + 4    # a second slot no other test uses


@pytest.fixture
def consumer():
    pool = mempool.Pool(backend="sim", capacity="1GiB", device=CONSUMER)
    _core._torch_register(CONSUMER, pool)
    yield pool
    _core._torch_unregister(CONSUMER)
    pool.check_invariants()


@pytest.fixture
def alloc(api, routed):
    """alloc(nbytes): a block of the routed pool, freed after the test if it was not."""
    live = []

    def make(nbytes):
        out = u()
        assert api.alloc(DEVICE, nbytes, 0, ctypes.byref(out)) == MP_OK
        live.append(out.value)
        return out.value
    yield make
    for ptr in live:
        if api.find_device(ptr) == DEVICE:
            api.free(DEVICE, ptr)


def share(api, device, ptr, cap=4096):
    buf = (ctypes.c_ubyte * cap)()
    n, offset = sz(), sz()
    rc = api.share(device, ptr, buf, cap, ctypes.byref(n), ctypes.byref(offset))
    return rc, bytes(buf[:n.value]) if rc == MP_OK else n.value, offset.value


def share_open(api, device, data):
    buf = (ctypes.c_ubyte * max(len(data), 1)).from_buffer_copy(data or b"\0")
    base, nbytes = u(), sz()
    rc = api.share_open(device, buf, len(data), ctypes.byref(base), ctypes.byref(nbytes))
    return rc, base.value, nbytes.value


def test_blocks_of_one_segment_give_one_handle_and_their_offsets(api, alloc):
    a, b = alloc(MiB), alloc(MiB)
    rc, one, off_a = share(api, DEVICE, a)
    assert rc == MP_OK and one
    rc, two, off_b = share(api, DEVICE, b)
    assert rc == MP_OK
    assert two == one and off_b - off_a == b - a      # the segment's handle, two offsets
    rc, needed, _ = share(api, DEVICE, a, cap=8)
    assert rc == MP_EINVAL and needed == len(one)      # the length needed, when too small
    api.free(DEVICE, a)
    api.free(DEVICE, b)
    # a now starts a free block (a and b merged): no live block there any more
    assert share(api, DEVICE, a)[0] == MP_EDOUBLEFREE


def test_a_handle_opens_on_another_devices_pool_counted_until_closed(api, alloc, consumer):
    a = alloc(3 * MiB)
    rc, data, offset = share(api, DEVICE, a)
    assert rc == MP_OK
    rc, base, nbytes = share_open(api, CONSUMER, data)
    assert rc == MP_OK and base and nbytes >= offset + 3 * MiB
    assert share_open(api, CONSUMER, data) == (MP_OK, base, nbytes)   # one mapping, counted
    assert api.share_close(CONSUMER, base) == MP_OK
    assert api.share_close(CONSUMER, base) == MP_OK
    assert api.share_close(CONSUMER, base) == MP_ENOTFOUND            # closed: not open now
    api.free(DEVICE, a)


def test_hostile_bytes_and_unrouted_devices_are_codes(api, alloc, consumer):
    a = alloc(MiB)
    rc, data, _ = share(api, DEVICE, a)
    assert rc == MP_OK
    for bad in (b"", b"M", bytes(len(data)), data[:-1], data[:8], b"\xff" * 300):
        assert share_open(api, CONSUMER, bad)[0] == MP_EINVAL, bad
    for device in (DEVICE + 1, -1, 64):
        assert share(api, device, a)[0] == MP_EINVAL
        assert share_open(api, device, data)[0] == MP_EINVAL
        assert api.share_close(device, a) == MP_EINVAL
    api.free(DEVICE, a)
