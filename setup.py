"""Build of the compiled core: one extension, the Cython layer plus the C data plane.

``MEMPOOL_DEBUG=1`` at build time makes the debug build: ``MP_DEBUG`` is defined, which turns
on the expensive internal asserts of the C core (mempool/_csrc/common/mp_assert.h), and the code is
built with -O1 -g. See docs/reliability.md.
"""
import glob
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

LAYERS = ("common", "core", "upstream", "glue", "testing")
DEBUG = os.environ.get("MEMPOOL_DEBUG", "").strip() not in ("", "0")

core = Extension(
    "mempool._core",
    sources=["mempool/_core.pyx"] + sorted(glob.glob("mempool/_csrc/*/*.c")),
    # The layers of the C data plane (docs/architecture.md); every header is included by its
    # bare name, from C and from the Cython `cdef extern` blocks alike.
    include_dirs=[f"mempool/_csrc/{layer}" for layer in LAYERS],
    define_macros=[("MP_DEBUG", "1")] if DEBUG else [],
    extra_compile_args=(["-O1", "-g", "-fno-omit-frame-pointer"] if DEBUG else ["-O3"])
    + ["-std=gnu11", "-Wall", "-Wno-unused-function", "-fno-semantic-interposition"],
    # Calls between the core's own functions bind inside the extension, with no PLT stub
    # and GOT entry on the way (two more cache lines for each cold call: Note [Hot lines]
    # in mp_internal.h); the symbols stay exported for ctypes (mempool.torch, the tests).
    extra_link_args=["-Wl,-Bsymbolic-functions"],
    libraries=["dl", "pthread"],
)

# Bounds and wraparound checks stay on (Cython's defaults): with them off, indexing a Python
# sequence past its end reads garbage as an object (a short tuple given to __dlpack__ was a
# segfault). A typed loop that never sees a Python object may turn them off locally with
# @cython.boundscheck(False) / @cython.wraparound(False).
setup(ext_modules=cythonize([core], language_level=3))
