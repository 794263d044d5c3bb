"""The stand-in CUDA driver (tests/data/fake_libcuda.c) and the harness that runs the CUDA
upstream's C functions on it in a fresh interpreter, shared by the tests of peer access
and of graph capture on it."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "data", "fake_libcuda.c")
G = 2 << 20   # the fake's granularity

HARNESS = r'''
import ctypes, json, sys
from ctypes import (CFUNCTYPE, POINTER, byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p,
                    create_string_buffer)

fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)   # found again as libcuda.so.1
for name, res in [("fake_make_pool", c_size_t), ("fake_make_shareable_pool", c_size_t), ("fake_pool_access", c_int),
                  ("fake_page_access", c_int), ("fake_mapped_pages", c_int),
                  ("fake_set_access_calls", c_int), ("fake_pool_set_access_calls", c_int),
                  ("fake_create_calls", c_int), ("fake_map_calls", c_int),
                  ("fake_live_handles", c_int)]:
    getattr(fake, name).restype = res
fake.fake_page_access.argtypes = [c_uint64]
fake.fake_pool_access.argtypes = [c_size_t]

from mempool import _core
core = ctypes.CDLL(_core.__file__)
core.mp_cuda_upstream.argtypes = [c_void_p, c_int, c_size_t, c_char_p, c_size_t]
core.mp_cuda_set_page_size.argtypes = [c_void_p, c_size_t, c_char_p, c_size_t]
core.mp_cuda_enable_peer_access.argtypes = [c_void_p, c_int, c_char_p, c_size_t]
core.mp_cuda_peer_devices.argtypes = [c_void_p, POINTER(c_int), c_size_t]
core.mp_cuda_peer_devices.restype = c_size_t
core.mp_cuda_access_mask.argtypes = [c_void_p, c_size_t, c_size_t, POINTER(c_uint64), c_char_p,
                                     c_size_t]
core.mp_cuda_set_shareable.argtypes = [c_void_p, c_int]
core.mp_cuda_share_message.argtypes = [c_char_p, c_size_t]
KINDS = {"pointer": c_void_p, "int": c_int, "size_t": c_size_t}


class Upstream(ctypes.Structure):   # the fields of mp_upstream.h, read from the header
    _fields_ = [(name, KINDS[kind]) for name, kind in json.loads(sys.argv[2])]


class Cuda:
    """The cuda-pool upstream of `device` over a fresh fake cudaMemPool (made exportable with
    shareable_pool)."""

    def __init__(self, device=0, shareable_pool=False):
        make = fake.fake_make_shareable_pool if shareable_pool else fake.fake_make_pool
        self.pool = make(device)
        self.up = Upstream()
        err = create_string_buffer(512)
        rc = core.mp_cuda_upstream(byref(self.up), device, self.pool, err, 512)
        assert rc == 0, err.value
        self.g = self.up.granularity

    def _fn(self, name, *types):
        return CFUNCTYPE(c_int, c_void_p, *types)(getattr(self.up, name))

    def reserve(self, nbytes):
        out = c_size_t()
        assert self._fn("va_reserve", c_size_t, POINTER(c_size_t))(self.up.ctx, nbytes,
                                                                 byref(out)) == 0
        return out.value

    def map(self, va, nbytes):
        return self._fn("map", c_size_t, c_size_t)(self.up.ctx, va, nbytes)

    def unmap(self, va, nbytes):
        return self._fn("unmap", c_size_t, c_size_t)(self.up.ctx, va, nbytes)

    def release(self, va, nbytes):
        return self._fn("va_release", c_size_t, c_size_t)(self.up.ctx, va, nbytes)

    def segment(self, nbytes):
        out = c_size_t()
        fn = self._fn("segment_alloc", c_size_t, c_size_t, POINTER(c_size_t))
        assert fn(self.up.ctx, nbytes, 0, byref(out)) == 0
        return out.value

    def set_page(self, page):
        err = create_string_buffer(512)
        rc = core.mp_cuda_set_page_size(byref(self.up), page, err, 512)
        self.g = self.up.granularity
        return rc, err.value.decode()

    def enable(self, peer):
        err = create_string_buffer(512)
        rc = core.mp_cuda_enable_peer_access(byref(self.up), peer, err, 512)
        return rc, err.value.decode()

    def peers(self):
        out = (c_int * 64)()
        n = core.mp_cuda_peer_devices(byref(self.up), out, 64)
        return list(out[:n])

    def access(self, addr, nbytes):
        mask = c_uint64(0)
        err = create_string_buffer(512)
        rc = core.mp_cuda_access_mask(byref(self.up), addr, nbytes, byref(mask), err, 512)
        return rc, mask.value

    def pages(self, va, n):
        """Access mask of pages va .. va + n pages (-1: unmapped)."""
        return [fake.fake_page_access(va + i * self.g) for i in range(n)]

    def set_shareable(self, on):
        return core.mp_cuda_set_shareable(byref(self.up), on), share_message()

    def share(self, base, nbytes, expandable=0):
        """(OK, the payload) or (code, the message)."""
        fn = self._fn("share", c_size_t, c_size_t, c_int, c_char_p, c_size_t, POINTER(c_size_t))
        buf, n = create_string_buffer(1 << 16), c_size_t()
        rc = fn(self.up.ctx, base, nbytes, expandable, buf, 1 << 16, byref(n))
        return rc, (buf.raw[:n.value] if rc == OK else share_message())

    def open(self, data, nbytes):
        """(OK, the address) or (code, the message)."""
        fn = self._fn("open", c_char_p, c_size_t, c_size_t, POINTER(c_size_t))
        out = c_size_t()
        rc = fn(self.up.ctx, data, len(data), nbytes, byref(out))
        return rc, (out.value if rc == OK else share_message())

    def close(self, ptr, nbytes):
        return self._fn("close", c_size_t, c_size_t)(self.up.ctx, ptr, nbytes)

    def destroy(self):
        CFUNCTYPE(None, c_void_p)(self.up.destroy)(self.up.ctx)


def share_message():
    buf = create_string_buffer(512)
    core.mp_cuda_share_message(buf, 512)
    return buf.value.decode()


OK, EINVAL, EUPSTREAM, EUNSUPPORTED, EBUSY = 0, 3, 8, 9, 10
'''


def build_fake_driver(tmp_path_factory):
    """Compile the stand-in libcuda.so.1 (skips the test without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the stand-in driver")
    folder = tmp_path_factory.mktemp("fake_cuda")
    lib = folder / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-std=gnu11", "-O1", "-Wl,-soname,libcuda.so.1",
                    "-o", str(lib), SOURCE], check=True, capture_output=True)
    return lib


def upstream_fields():
    """[(name, "pointer" | "int" | "size_t")] of struct mp_upstream, in order, from its header,
    so that the ctypes mirror follows the contract as it changes."""
    with open(os.path.join(ROOT, "mempool", "_csrc", "upstream", "mp_upstream.h")) as f:
        text = f.read()
    body = re.search(r"typedef struct mp_upstream \{(.*?)\} mp_upstream;", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", " ", body, flags=re.S)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        fn = re.search(r"\(\*(\w+)\)", decl)
        if fn:
            fields.append((fn.group(1), "pointer"))
            continue
        typ, name = re.match(r"(.*?)(\w+)$", decl).groups()
        fields.append((name, "pointer" if "*" in typ else typ.replace("const", "").strip()))
    assert fields[0] == ("ctx", "pointer") and ("granularity", "size_t") in fields, fields
    return fields


def run_fake(lib, body, **env):
    """Run `body` after HARNESS in a fresh interpreter whose libcuda.so.1 is the fake."""
    environ = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   LD_LIBRARY_PATH=str(lib.parent) + os.pathsep
                   + os.environ.get("LD_LIBRARY_PATH", ""), **env)
    code = HARNESS + textwrap.dedent(body) + "\nprint('done')\n"
    out = subprocess.run([sys.executable, "-c", code, str(lib), json.dumps(upstream_fields())],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=environ)
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stdout + out.stderr
    return out.stdout
