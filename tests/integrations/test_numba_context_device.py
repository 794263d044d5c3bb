"""mempool.numba's reading of a Numba context's device, without Numba: a context Numba makes
holds a Device with an integer .id; one built around a handle another library retained
(driver.Context(CUdevice(0), handle), as Numba's own test_attached_primary makes) holds the
driver's CUdevice, whose int() is the ordinal."""
import pytest

from mempool.numba import _context_device


class Context:
    def __init__(self, device):
        self.device = device


class Device:          # numba's Device: the ordinal as .id
    def __init__(self, id):
        self.id = id


class CUdevice:        # cuda.bindings.driver.CUdevice: no .id, int() is the ordinal
    def __init__(self, ordinal):
        self._ordinal = ordinal

    def __int__(self):
        return self._ordinal


def test_a_numba_device_gives_its_id_and_a_cudevice_its_int():
    assert _context_device(Context(Device(3))) == 3
    assert _context_device(Context(CUdevice(2))) == 2
    assert _context_device(Context(Device(CUdevice(1)))) == 1   # Device.id as a CUdevice


def test_a_device_with_no_ordinal_is_refused_saying_what_it_was():
    class TestCaseLike:
        def id(self):               # unittest.TestCase.id: a method, not an ordinal
            return "test"

    for device in (TestCaseLike(), None, "0x1", Device(True)):
        with pytest.raises(TypeError, match="cannot tell the device of Numba context .*: "
                                            "its device is a"):
            _context_device(Context(device))
