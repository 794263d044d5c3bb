"""mp_config (mempool/_csrc/core/mp_core.h) as ctypes sees it, for tests that call the core's
C API or the torch table directly. Its fields must follow the header's, in order: a struct
shorter than the C one would be overrun by every call that fills it."""
import ctypes

from mempool import _core

sz, i32 = ctypes.c_size_t, ctypes.c_int


class Config(ctypes.Structure):
    _fields_ = [("max_split_size", sz), ("release_threshold", sz),
                ("roundup_divisions", sz * _core.ROUNDUP_INTERVALS),
                ("cross_stream_reuse", i32), ("segment_round", sz),
                ("limit", sz), ("initial_pool_size", sz),
                ("gc_threshold", ctypes.c_double), ("expandable_segments", i32),
                ("expandable_reserve", sz), ("max_map_size", sz), ("min_map_size", sz),
                ("capture_reuse", i32), ("keep_idle", i32), ("no_split", i32),
                ("map_ahead", sz)]
