"""Build of the compiled core: one extension, the Cython layer plus the C data plane.

``MEMPOOL_DEBUG=1`` at build time makes the debug build: ``MP_DEBUG`` is defined, which turns
on the expensive internal asserts of the C core (mempool/_csrc/common/mp_assert.h), and the code is
built with -O1 -g. See docs/reliability.md.

Builds are incremental. The generated C stays next to its .pyx and Cython runs again only
when a .pyx, .pxd or .pxi is newer than it. The object files stay in build/ next to this file
(one folder per Python and per build kind), and a source is compiled again only when it, a
header or this file is newer than its object. pip builds each `pip install -e .` in a new
temporary folder, so without this the second of the README's two installs compiled everything
again. ``--force`` (``python setup.py build_ext --force``) regenerates and compiles everything.
The sources are compiled side by side, one compiler per CPU (``MEMPOOL_BUILD_JOBS=N`` sets
another number).
"""
import glob
import os
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = ("common", "core", "upstream", "glue", "testing")
DEBUG = os.environ.get("MEMPOOL_DEBUG", "").strip() not in ("", "0")

PYX, GENERATED_C = "mempool/_core.pyx", "mempool/_core.c"
CYTHON_INPUTS = sorted(glob.glob("mempool/*.pyx") + glob.glob("mempool/*.pxd")
                       + glob.glob("mempool/*.pxi"))
FORCE = "--force" in sys.argv or "-f" in sys.argv


def _stale(obj, inputs):
    """True when `obj` is missing or older than any of `inputs`."""
    if not os.path.exists(obj):
        return True
    built = os.path.getmtime(obj)
    return any(os.path.getmtime(path) > built for path in inputs)


# Cython is run only when the generated C is older than one of the project's Cython files.
# cythonize's own check also counts the Cython includes it cimports from (libc, cpython),
# which pip installs anew, with new times, into each isolated build environment: every
# `pip install -e .` regenerated the C, and so recompiled it.
REGENERATE = FORCE or _stale(GENERATED_C, CYTHON_INPUTS)

core = Extension(
    "mempool._core",
    sources=[PYX if REGENERATE else GENERATED_C] + sorted(glob.glob("mempool/_csrc/*/*.c")),
    # The layers of the C data plane (docs/architecture.md); every header is included by its
    # bare name, from C and from the Cython `cdef extern` blocks alike.
    include_dirs=[f"mempool/_csrc/{layer}" for layer in LAYERS],
    # Any of them may change what any source compiles to: a change to one recompiles all.
    depends=sorted(glob.glob("mempool/_csrc/*/*.h")) + ["setup.py"],
    define_macros=[("MP_DEBUG", "1")] if DEBUG else [],
    extra_compile_args=(["-O1", "-g", "-fno-omit-frame-pointer"] if DEBUG else ["-O3"])
    + ["-std=gnu11", "-Wall", "-Wno-unused-function", "-fno-semantic-interposition"],
    # Calls between the core's own functions bind inside the extension, with no PLT stub
    # and GOT entry on the way (two more cache lines for each cold call: Note [Hot lines]
    # in mp_internal.h); the symbols stay exported for ctypes (mempool.torch, the tests).
    extra_link_args=["-Wl,-Bsymbolic-functions"],
    libraries=["dl", "pthread", "rt"],   # rt: shm_open (the ledger of Note [The consumers' ledger]) on glibc before 2.34
)


def _jobs():
    value = os.environ.get("MEMPOOL_BUILD_JOBS", "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        sys.exit(f"MEMPOOL_BUILD_JOBS={value!r}: expected a whole number of jobs, 1 or more")
    return int(value)


class BuildExt(build_ext):
    """build_ext with the object files kept between builds (see the module's docstring) and
    the sources of an extension compiled in parallel (setuptools' own `parallel` runs one
    extension per job, and there is only one)."""

    def finalize_options(self):
        super().finalize_options()
        kind = "debug" if DEBUG else "release"
        folder = f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}-{kind}"
        self.build_temp = os.path.join(HERE, "build", folder)

    def build_extension(self, ext):
        compiler, force, jobs = self.compiler, self.force, _jobs()

        def compile_sources(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                            extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

            def one(obj):
                src, src_ext = build[obj]
                if force or _stale(obj, [src, *(depends or ())]):
                    compiler._compile(obj, src, src_ext, cc_args, extra, pp_opts)

            # The largest source first (the Cython module), so it is never the last to start.
            order = sorted(objects, key=lambda o: -os.path.getsize(build[o][0]))
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(one, order))
            return objects

        compiler.compile = compile_sources
        super().build_extension(ext)


# Bounds and wraparound checks stay on (Cython's defaults): with them off, indexing a Python
# sequence past its end reads garbage as an object (a short tuple given to __dlpack__ was a
# segfault). A typed loop that never sees a Python object may turn them off locally with
# @cython.boundscheck(False) / @cython.wraparound(False).
setup(ext_modules=cythonize([core], language_level=3, force=FORCE) if REGENERATE else [core],
      cmdclass={"build_ext": BuildExt})
