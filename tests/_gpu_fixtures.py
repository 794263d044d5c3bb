"""Fixtures of the GPU tier: kernels that write, check and race on pool memory.

tests/conftest.py imports them, so that every test sees them however pytest is invoked. In
one run on the H200 (pytest 9.1 with xdist, files of tests/gpu named on the command line
among one of tests/) the tests of tests/gpu did not see the fixtures of a conftest.py of
their own folder, while those of tests/conftest.py were seen; the cause was not established. Every module of tests/gpu skips itself when
``mempool._cuda.available()`` is False, so that a machine without a device, CuPy or the CUDA
driver skips the tier cleanly; these fixtures import CuPy only when a test asks for them.
"""
import gc

import pytest

_SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned int pattern(unsigned long long i, unsigned int seed) {
    return (unsigned int)(i * 2654435761ull) ^ seed;
}

/* Wait spin_ns, then copy: a reader that is still reading long after it was queued. */
extern "C" __global__ void spin_copy(const unsigned int *src, unsigned int *dst,
                                     unsigned long long n, unsigned long long spin_ns) {
    if (spin_ns) {
        unsigned long long t0 = now_ns();
        while (now_ns() - t0 < spin_ns) { }
    }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

extern "C" __global__ void fill(unsigned int *dst, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = pattern(i, seed);
}

extern "C" __global__ void count_bad(const unsigned int *src, unsigned long long n,
                                     unsigned int seed, unsigned long long *bad) {
    unsigned long long mine = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        mine += src[i] != pattern(i, seed);
    if (mine) atomicAdd(bad, mine);
}
"""


class Kernels:
    """Launchers over raw pool memory. Sizes are in bytes; a trailing partial word is left
    alone, so any nbytes >= 4 works."""

    BLOCK = 256
    GRID = 1024

    def __init__(self):
        import cupy
        self.cupy = cupy
        module = cupy.RawModule(code=_SOURCE)
        self._spin_copy = module.get_function("spin_copy")
        self._fill = module.get_function("fill")
        self._count_bad = module.get_function("count_bad")

    def view(self, ptr, nbytes, owner, device=0, dtype="uint32"):
        """A CuPy array over pool memory that CuPy does not own."""
        cupy = self.cupy
        itemsize = cupy.dtype(dtype).itemsize
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
        return cupy.ndarray((nbytes // itemsize,), dtype, cupy.cuda.MemoryPointer(mem, 0))

    def _grid(self, n):
        return (max(1, min(self.GRID, (n + self.BLOCK - 1) // self.BLOCK)),)

    def fill(self, ptr, nbytes, seed, stream):
        """Queue a write of the seed's pattern over [ptr, ptr + nbytes) on `stream`."""
        n = nbytes // 4
        with stream:
            self._fill(self._grid(n), (self.BLOCK,), (self._u64(ptr), self._u64(n),
                                                     self._u32(seed)))

    def count_bad(self, ptr, nbytes, seed, stream):
        """Words of [ptr, ptr + nbytes) that differ from the seed's pattern (synchronizes)."""
        cupy = self.cupy
        n = nbytes // 4
        with stream:
            bad = cupy.zeros(1, dtype=cupy.uint64)
            self._count_bad(self._grid(n), (self.BLOCK,), (self._u64(ptr), self._u64(n),
                                                          self._u32(seed), bad))
            return int(bad.get()[0])

    def spin_copy(self, src, dst, nbytes, spin_ms, stream):
        """Queue, on `stream`: wait spin_ms on the device, then copy src to dst."""
        n = nbytes // 4
        with stream:
            self._spin_copy(self._grid(n), (self.BLOCK,),
                            (self._u64(src), self._u64(dst), self._u64(n),
                             self._u64(int(spin_ms * 1e6))))

    def _u64(self, v):
        return self.cupy.uint64(v)

    def _u32(self, v):
        return self.cupy.uint32(v & 0xFFFFFFFF)


@pytest.fixture(scope="session")
def kernels():
    return Kernels()


@pytest.fixture
def cupy_device():
    """Device 0 current, and CuPy's own caches emptied before and after the test, so that
    device-wide figures (free memory, the default pool's attributes) are the test's own."""
    import cupy
    with cupy.cuda.Device(0):
        _drain_cupy(cupy)
        yield cupy
        cupy.cuda.Device(0).synchronize()
        _drain_cupy(cupy)


def _drain_cupy(cupy):
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


@pytest.fixture
def streams(cupy_device):
    """Two non-blocking CuPy streams, synchronized at the end of the test."""
    cupy = cupy_device
    a = cupy.cuda.Stream(non_blocking=True)
    b = cupy.cuda.Stream(non_blocking=True)
    yield a, b
    a.synchronize()
    b.synchronize()


@pytest.fixture
def cuda_pool(cupy_device):
    """A factory of Pool(backend="cuda") on device 0; each pool's invariants are checked and
    the pool dropped at the end of the test."""
    import mempool
    made = []

    def make(**options):
        pool = mempool.Pool(backend="cuda", device=0, **options)
        made.append(pool)
        return pool

    yield make
    cupy_device.cuda.Device(0).synchronize()
    for pool in made:
        pool.check_invariants()
    made.clear()
    gc.collect()



@pytest.fixture
def held_cupy_arrays():
    """The function below, for tests' assertion messages."""
    return describe_held_cupy_arrays


def describe_held_cupy_arrays():
    """What still holds the CuPy arrays alive in this process, for an assertion's message
    when a pool's blocks outlive the arrays a test dropped: each array's size and the chain
    of its referrers (a frame names its function, file and line), two levels up."""
    import cupy

    def describe(obj):
        if type(obj).__name__ == "frame":
            return f"frame {obj.f_code.co_name} at {obj.f_code.co_filename}:{obj.f_lineno}"
        return type(obj).__name__

    gc.collect()
    lines = []
    arrays = [o for o in gc.get_objects() if isinstance(o, cupy.ndarray) and o.nbytes]
    for arr in arrays[:8]:
        lines.append(f"array of {arr.nbytes} B at {arr.data.ptr:#x} held by:")
        for ref in gc.get_referrers(arr):
            if ref is arrays:
                continue
            lines.append(f"  {describe(ref)}")
            for ref2 in gc.get_referrers(ref)[:4]:
                if ref2 is not arrays:
                    lines.append(f"    <- {describe(ref2)}")
    return "\n".join(lines) or "no CuPy array is alive"
