# cython: language_level=3, binding=True, embedsignature=True, embedsignature.format=clinic
"""The compiled core of mempool: the Pool class over the C data plane, and its devices.

One extension (PyTorch's allocator glue loads the same .so), split by concern into include
files that read as modules. Every C declaration is in _cdefs.pxd. The parts are included in
the order below, and each uses only the parts included before it: helpers take the C pool,
its backend kind or a cudaMemPool handle, never a Pool, so nothing below the Pool calls back
up into it. The parts after _pool.pxi take a Pool and are used by nothing before them.
"""
cimport cython
from mempool._cdefs cimport *

include "_common.pxi"    # argument checks (sizes, addresses, streams), backend kinds
# Before anything imports mempool._config: _config reads the size policy from this module
# while it is still being initialised.
include "_policy.pxi"    # the size policy and trace action names, exported to Python
include "_cuda.pxi"      # the CUDA upstream's entry points
include "_streams.pxi"   # CuPy's current stream (Note [Current stream])
include "_cudapool.pxi"  # the cudaMemPool behind a cuda pool
include "_peers.pxi"     # several devices: which device a sim pool is, peer access
include "_devices.pxi"   # SimDevice and HostDevice, the test controls of pool.device
include "_buffer.pxi"    # Buffer, the DLPack bridge
include "_pool.pxi"      # the Pool, and CuPy's allocator hook
include "_torch.pxi"     # the PyTorch pluggable allocator's registry
include "_bench.pxi"     # compiled benchmark loops
include "_capture.pxi"   # the pool's capture counter, for tests
