"""DLPack's C structs through ctypes, to read capsules as a consumer does (the DLPack tests
and the upstream contract share them)."""
import ctypes

# They mirror dlpack.h v1.1 (mempool/_csrc/glue/mp_dlpack.h); a disagreement reads as garbage.

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))),
]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

READ_ONLY, IS_COPIED = 1 << 0, 1 << 1


def capsule_name(capsule):
    return _api.PyCapsule_GetName(capsule).decode()


def managed(capsule):
    """The managed tensor inside an unconsumed capsule (legacy or versioned). It lives only
    as long as the capsule: keep the capsule in a variable while reading it."""
    name = capsule_name(capsule)
    ptr = _api.PyCapsule_GetPointer(capsule, name.encode())
    cls = DLManagedTensorVersioned if name == "dltensor_versioned" else DLManagedTensor
    return ctypes.cast(ptr, ctypes.POINTER(cls))


def consume(capsule):
    """Take the tensor out of a capsule as a consumer does: rename it "used_..." so its
    destructor leaves the tensor alone. The caller then owes the deleter call."""
    name = capsule_name(capsule)
    t = managed(capsule)
    assert _api.PyCapsule_SetName(capsule, ("used_" + name).encode()) == 0
    return t


def dims(t):
    dl = t.contents.dl_tensor
    return (tuple(dl.shape[i] for i in range(dl.ndim)),
            tuple(dl.strides[i] for i in range(dl.ndim)))
