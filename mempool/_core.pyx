# cython: language_level=3, binding=True, embedsignature=True, embedsignature.format=clinic
"""The compiled core of mempool: the Pool class over the C data plane, and its devices.

One extension (PyTorch's allocator glue loads the same .so), split by concern into include
files that read as modules. Every C declaration is in _cdefs.pxd. The parts share one
namespace, so the order below is a rule: each part uses only names that the parts included
before it define (the names other parts use are listed beside each include). Helpers take the
C pool, its backend kind or a cudaMemPool handle, never a Pool, so nothing below the Pool
calls back up into it. The parts after _pool.pxi take a Pool and are used by nothing before
them, with one exception: Pool.malloc calls _cupy_malloc, as CuPy's hook holds a Pool in the
owner of each block it hands out. tests/project/test_extension_layout.py checks this.
"""
cimport cython
from mempool._cdefs cimport *

# Argument checks and backend kinds: _as_nbytes, _as_pointer, stream_handle, _not_initialised,
# _BACKENDS, _CUDA, _SIM, _HOST.
include "_common.pxi"
# Before anything imports mempool._config: _config reads the size policy from this module
# while it is still being initialised. The size policy and trace action names, exported to
# Python: TRACE_ACTIONS.
include "_policy.pxi"
# The CUDA upstream's entry points: _make_cuda_upstream, _set_cuda_page_size,
# _cuda_error_text.
include "_cuda.pxi"
# CuPy's current stream (Note [Current stream]): _CurrentStream.
include "_streams.pxi"
# The cudaMemPool behind a cuda pool: _make_cuda, _cuda_current_stream, _cuda_stats,
# _cuda_set_release_threshold.
include "_cudapool.pxi"
# Several devices, which device a sim pool is, peer access: _sim_place, _enable_peer_access,
# _peer_devices, _access_devices.
include "_peers.pxi"
# SimDevice and HostDevice, the test controls of pool.device: _make_device.
include "_devices.pxi"
# Buffer, the DLPack bridge: _buffer_request, _buffer_wrap.
include "_buffer.pxi"
# Making a pool's C core from its options: _pool_create, _or_unlimited, _limit_bytes.
include "_pool_create.pxi"
# The errors of refused calls: _closed_error, _forked_error, _pointer_error, _oom_error,
# _close_refusal.
include "_pool_errors.pxi"
# Sharing blocks with other processes: SharedHandle, _Sharing, _share_export, _share_import,
# _share_collect, _share_pinned_free.
include "_share.pxi"
# Giving memory back, the size policy of a live pool: _give_back, _set_size_policy.
include "_pool_retention.pxi"
# What a pool shows of itself: live_pools (_live_pools, _pool_numbers), _pool_stats,
# _check_invariants, _pool_layout, _record_history, _pool_history.
include "_pool_observe.pxi"
# The Pool class (its methods delegate to the parts above): Pool.
include "_pool.pxi"
# CuPy's allocator hook, Pool.malloc's work: _cupy_malloc.
include "_cupy_hook.pxi"
# The PyTorch pluggable allocator's registry.
include "_torch.pxi"
# Compiled benchmark loops.
include "_bench.pxi"
# Test controls: the pool's capture counter, a shared limit.
include "_capture.pxi"
