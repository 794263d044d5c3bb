# cython: language_level=3
"""The compiled core of mempool: the Pool class over the C data plane, and its devices.

Split by concern into include files: _pool.pxi (the Pool), _devices.pxi (the simulated and
host devices' test controls), _peers.pxi (several devices: peer access), _buffer.pxi (the
DLPack bridge), _torch.pxi (the PyTorch pluggable allocator's registry), _capture.pxi (the
pool's capture counter, for tests).
"""
cimport cython
from mempool._cdefs cimport *

include "_cuda.pxi"
include "_streams.pxi"
include "_pool.pxi"
include "_cudapool.pxi"
include "_peers.pxi"
include "_devices.pxi"
include "_buffer.pxi"
include "_torch.pxi"
include "_bench.pxi"
include "_capture.pxi"
