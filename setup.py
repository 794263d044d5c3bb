"""Build of the compiled core: one extension, the Cython layer plus the C data plane."""
import glob

from Cython.Build import cythonize
from setuptools import Extension, setup

core = Extension(
    "mempool._core",
    sources=["mempool/_core.pyx"] + sorted(glob.glob("mempool/_csrc/*.c")),
    include_dirs=["mempool/_csrc"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    libraries=["dl", "pthread"],
)

setup(ext_modules=cythonize([core], language_level=3, compiler_directives={
    "boundscheck": False, "wraparound": False, "cdivision": True,
}))
