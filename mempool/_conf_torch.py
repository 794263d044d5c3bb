"""Pool options, part two: PyTorch's allocator keys (``PYTORCH_CUDA_ALLOC_CONF``). Which of
them the pool reads, how (``max_split_size_mb`` in MB, ``per_process_memory_fraction`` as a
fraction of the device), which it ignores and why, and which PyTorch itself still applies
when the pool is its CUDA allocator. ``mempool._config`` is the way in.
"""
from __future__ import annotations

import operator
from typing import Any

from mempool._conf_parse import (BACKENDS, MiB, _ascii_digits, _entries, _error, _is_int,
                                 _is_none_word, _mib, _spelled, _warn_once)
from mempool._core import (LARGE_BUFFER, LARGE_ROUND, LARGE_SEGMENT, MIN_LARGE_ALLOC,
                           SMALL_SEGMENT, SMALL_SIZE)


# The readers of PyTorch's spellings of our options (the table of them, _ALIASES, is in
# mempool/_conf_options.py): a whole number of MB, and a fraction of the device.
def _mb_to_bytes(value: Any, key: str) -> int:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and _ascii_digits(text):
        return int(text) * MiB
    if _is_int(text) and operator.index(text) >= 0:
        return operator.index(text) * MiB
    raise _error(key, value, "a whole number of MB (MB = 2**20 bytes), as in PyTorch")


def _mb_or_none(value: Any, key: str) -> int | None:
    # The none-words pass through: the option's own parser accepts or refuses None.
    return None if _is_none_word(value) else _mb_to_bytes(value, key)


def _pytorch_fraction(value: Any, key: str) -> float:
    accepted = "a fraction of device memory in (0, 1]"
    if isinstance(value, str) and not value.isascii():
        raise _error(key, value, accepted, "not an ASCII number")
    try:
        v = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise _error(key, value, accepted) from None
    if isinstance(value, bool) or not 0.0 < v <= 1.0:
        raise _error(key, value, accepted)
    return v


_NO_PINNED = "it configures PyTorch's pinned host-memory allocator, which stays PyTorch's " \
             "when the pool serves CUDA tensors"
_NO_LOCK = "it concerns PyTorch's allocator lock; the pool's lock rules are fixed " \
           "(see docs/architecture.md)"

# Every other key of PyTorch's allocator config (torch 2.13: AcceleratorAllocatorConfig and
# CUDAAllocatorConfig; 2.11 has a subset), with the reason it has no meaning for the pool.
# A conf string may hold them (a warning says they are ignored); keywords may not.
_PYTORCH_IGNORED: dict[str, str] = {
    "large_segment_size_mb": f"segment sizes are fixed here: {_mib(SMALL_SEGMENT)} for requests "
                             f"up to {_mib(SMALL_SIZE)}, {_mib(LARGE_SEGMENT)} for requests under "
                             f"{_mib(MIN_LARGE_ALLOC)}, larger ones rounded to {_mib(LARGE_ROUND)}",
    "max_non_split_rounding_mb": f"an unsplit (oversize) block serves requests up to "
                                 f"{_mib(LARGE_BUFFER)} smaller than itself; the slack is fixed",
    "release_lock_on_cudamalloc": _NO_LOCK,
    "release_lock_on_hipmalloc": _NO_LOCK,
    "pinned_use_cuda_host_register": _NO_PINNED,
    "pinned_use_hip_host_register": _NO_PINNED,
    "pinned_num_register_threads": _NO_PINNED,
    "pinned_use_background_threads": _NO_PINNED,
    "pinned_max_round_threshold_mb": _NO_PINNED,
    "pinned_max_cached_size_mb": _NO_PINNED,
    "pinned_reserve_segment_size_mb": _NO_PINNED,
    "pinned_free_catch_all": _NO_PINNED,
    "throw_on_cudamalloc_oom": "the pool's limit always refuses a request before the driver "
                               "is asked, with an out-of-memory error (and PyTorch's OOM "
                               "rejection observers hear of it); there is nothing to switch on",
}


def pytorch_key_ignored_because(key: str) -> str:
    """Why PyTorch's allocator key `key` has no meaning for the pool, in words."""
    if key == "backend":
        return "it picks one of PyTorch's own allocators, and the pool took their place"
    return _PYTORCH_IGNORED.get(key, "the pool has no such option")


# What PyTorch's cudaMallocAsync backend ignores (it has no cache to tune); given with
# backend:cudaMallocAsync, the pool ignores them too, as PyTorch would.
_CACHE_OPTIONS = ("max_split_size", "roundup_power2_divisions", "garbage_collection_threshold",
                  "expandable_segments")

# Every key PyTorch's allocator config accepts (torch 2.13).
PYTORCH_KEYS = frozenset(
    ("backend", "max_split_size_mb", "per_process_memory_fraction", "roundup_power2_divisions",
     "garbage_collection_threshold", "expandable_segments", "graph_capture_record_stream_reuse")
    + tuple(_PYTORCH_IGNORED))
# The keys PyTorch still applies when the pool is its CUDA allocator: those of its pinned
# host-memory allocator, which stays PyTorch's.
PYTORCH_HOST_KEYS = frozenset(k for k in _PYTORCH_IGNORED if k.startswith("pinned_"))


# Ours, as the warning lists them: the one a PyTorch string most likely means first.
_OWN_BACKENDS = ("cuda",) + tuple(b for b in BACKENDS if b != "cuda")


def _backend_ignored(value: str, source: str) -> None:
    if value == "native":
        what = "PyTorch's own caching allocator"
    else:
        what = (f"PyTorch's {value} allocator (the pool's backend 'cuda' draws its segments "
                "from a cudaMemPool with cudaMallocFromPoolAsync)")
    _warn_once(("backend", value),
               f"{source}: 'backend:{value}' selects {what}; the pool takes the place of "
               "PyTorch's allocator, so it has no meaning for the pool and is ignored "
               f"(mempool's own backend values are {_spelled(_OWN_BACKENDS, 'and')})")


def split_pytorch_conf(conf: str, source: str = "conf") -> tuple[str, list[str]]:
    """Split a PyTorch allocator conf string for a process whose CUDA allocator is the pool.

    Returns
    -------
    (str, list of str)
        The entries PyTorch still applies then, as written and in order: those of its pinned
        host-memory allocator (:data:`PYTORCH_HOST_KEYS`); and the keys of the other
        entries, which configure the allocator the pool replaces, or are mempool's own
        (PyTorch refuses a key it does not know, and checks ``backend`` against the
        allocator in use).
    """
    kept, dropped = [], []
    for key, value in _entries(conf, source):
        if key in PYTORCH_HOST_KEYS:
            kept.append(f"{key}:{value}")
        else:
            dropped.append(key)
    return ",".join(kept), dropped
