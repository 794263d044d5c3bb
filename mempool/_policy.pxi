# The C core's facts that the Python side shares, exported from the one place they are
# defined (mp_core.h) instead of copied: the size policy (mempool._config validates options
# against it), the names of the trace actions (Pool.history, mempool.tools) and the block
# states (Pool.layout, mempool.tools.report).
#
# Included before anything imports mempool._config: _config reads these names from this
# module while the module is still being initialised (the constants are set by then).
from libc.stdint cimport uintptr_t

#: The size policy (mp_core.h): the smallest block; requests up to SMALL_SIZE use the small
#: lists and SMALL_SEGMENT segments; requests below MIN_LARGE_ALLOC take LARGE_SEGMENT
#: segments; larger ones are rounded to LARGE_ROUND; an unsplit block serves requests up to
#: LARGE_BUFFER more than it holds; MAX_ALLOC is the largest request served;
#: ROUNDUP_INTERVALS is the number of power-of-two intervals of roundup_power2_divisions;
#: UNLIMITED is the size that means "no limit"; DEFAULT_MAX_MAP is the most bytes one
#: physical allocation of expandable segments holds unless max_map_size says.
MIN_BLOCK = MP_MIN_BLOCK
SMALL_SIZE = MP_SMALL_SIZE
SMALL_SEGMENT = MP_SMALL_SEGMENT
LARGE_SEGMENT = MP_LARGE_SEGMENT
MIN_LARGE_ALLOC = MP_MIN_LARGE_ALLOC
LARGE_ROUND = MP_LARGE_ROUND
LARGE_BUFFER = MP_LARGE_BUFFER
MAX_ALLOC = MP_MAX_ALLOC
ROUNDUP_INTERVALS = MP_ROUNDUP_INTERVALS
UNLIMITED = MP_UNLIMITED
DEFAULT_MAX_MAP = MP_DEFAULT_MAX_MAP

# The trace actions by their C code (mp_core.h MP_TRACE_*), spelled as PyTorch's TraceEntry
# names them.
_TRACE_ACTION_NAMES = {
    MP_TRACE_ALLOC: "alloc",
    MP_TRACE_FREE_REQUESTED: "free_requested",
    MP_TRACE_FREE_COMPLETED: "free_completed",
    MP_TRACE_SEGMENT_ALLOC: "segment_alloc",
    MP_TRACE_SEGMENT_FREE: "segment_free",
    MP_TRACE_OOM: "oom",
    MP_TRACE_SEGMENT_MAP: "segment_map",
    MP_TRACE_SEGMENT_UNMAP: "segment_unmap",
    MP_TRACE_EMPTY_CACHE: "empty_cache",
    MP_TRACE_TRIM: "trim",
}
#: ``TRACE_ACTIONS[code]`` is the name of trace action ``code`` (Pool.history's first field).
TRACE_ACTIONS = tuple(_TRACE_ACTION_NAMES[code] for code in range(len(_TRACE_ACTION_NAMES)))

#: The block states of Pool.layout() (mp_core.h MP_BLOCK_*).
BLOCK_FREE = MP_BLOCK_FREE
BLOCK_ALLOCATED = MP_BLOCK_ALLOCATED
BLOCK_PENDING = MP_BLOCK_PENDING
BLOCK_UNMAPPED = MP_BLOCK_UNMAPPED

from mempool import _config


def round_size(nbytes, roundup_power2_divisions=0):
    """The size a request is rounded to under the given rounding divisions."""
    cdef mp_config cfg
    mp_config_default(&cfg)
    divs = _config.parse_roundup_divisions(roundup_power2_divisions)
    for i, d in enumerate(divs):
        cfg.roundup_divisions[i] = d
    return mp_round_size(&cfg, _as_nbytes(nbytes, "nbytes"))


def segment_size(rounded):
    """The size of the segment a rounded request of this size makes."""
    return mp_segment_size(_as_nbytes(rounded, "rounded"))


def size_class(nbytes):
    """The free-list class a block of this size is binned in."""
    return mp_size_class(_as_nbytes(nbytes, "nbytes"))
