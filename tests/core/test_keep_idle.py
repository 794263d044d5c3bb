"""Note [Keep idle] (mp_core.c): a pool that gives no idle segment back on its own, as the
torch glue makes its private pools (mp_torch_private_config, mp_torch.c).

The free blocks of a live CUDA graph's private pool are the capture's intermediates, which
every replay writes. A segment of them given back by a growth's release rules (or an
out-of-memory retry) would be freed memory the graph still writes; PyTorch's allocator
gives a graph's pool back only once the graph is gone. On sim, through the core's C API."""
import ctypes

import pytest

from mempool import _core
from _core_config import Config

core = ctypes.CDLL(_core.__file__)
MiB = 1 << 20
sz, u, i32, vp = ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p


core.mp_config_default.argtypes = [ctypes.POINTER(Config)]
core.mp_torch_private_config.argtypes = [ctypes.POINTER(Config), ctypes.POINTER(Config)]
core.mp_sim_upstream.argtypes = [vp, sz, sz]
core.mp_pool_create.argtypes = [ctypes.POINTER(Config), vp, ctypes.POINTER(vp)]
core.mp_pool_release.argtypes = [vp]
core.mp_alloc.argtypes = [vp, sz, u, ctypes.POINTER(u)]
core.mp_free.argtypes = [vp, u, u, i32]
core.mp_reserved_bytes.argtypes = [vp]
core.mp_reserved_bytes.restype = sz
core.mp_empty_cache.argtypes = [vp]
core.mp_check_invariants.argtypes = [vp, ctypes.c_char_p, sz]
MP_OK, MP_ENOMEM, MP_ELIMIT = 0, 1, 2   # mp_upstream.h


def make_pool(cfg, capacity=1 << 30):
    upstream = ctypes.create_string_buffer(4096)   # an mp_upstream, filled by the sim
    assert core.mp_sim_upstream(upstream, capacity, 2 * MiB) == MP_OK
    pool = vp()
    assert core.mp_pool_create(ctypes.byref(cfg), upstream, ctypes.byref(pool)) == MP_OK
    return pool


def alloc(pool, nbytes):
    out = u()
    rc = core.mp_alloc(pool, nbytes, 0, ctypes.byref(out))
    return rc, out.value


def check(pool):
    msg = ctypes.create_string_buffer(512)
    assert core.mp_check_invariants(pool, msg, 512) == MP_OK, msg.value


def default_config():
    cfg = Config()
    core.mp_config_default(ctypes.byref(cfg))
    return cfg


def private_config():
    device = default_config()
    device.release_threshold = 0          # whatever the device pool gives back ...
    device.gc_threshold = 0.5
    device.limit = 512 * MiB
    device.capture_reuse = 1              # Note [Capture reuse]: a graph's pool follows it
    cfg = Config()
    core.mp_torch_private_config(ctypes.byref(device), ctypes.byref(cfg))
    return cfg


def test_the_glues_private_pools_keep_their_idle_segments():
    cfg = private_config()
    assert cfg.keep_idle == 1
    # ... a private pool keeps everything and has no limit of its own.
    assert cfg.release_threshold == cfg.limit == ctypes.c_size_t(-1).value
    assert cfg.gc_threshold == 0.0 and cfg.expandable_segments == 0
    assert cfg.segment_round == 0 and cfg.cross_stream_reuse == 0
    assert default_config().keep_idle == 0
    assert cfg.capture_reuse == 1 and default_config().capture_reuse == 0


@pytest.mark.parametrize("keep_idle", [0, 1])
def test_a_growth_releases_beyond_need_unless_the_pool_keeps_idle(keep_idle):
    """Two idle 32 MiB segments (a graph's intermediates) and a 48 MiB request neither can
    hold: the default releases them before it grows; a pool that keeps idle grows beside
    them, and gives them back only when emptied."""
    cfg = default_config()
    cfg.keep_idle = keep_idle
    pool = make_pool(cfg)
    try:
        blocks = [alloc(pool, 32 * MiB) for _ in range(2)]
        assert all(rc == MP_OK for rc, _ in blocks)
        for _, ptr in blocks:
            core.mp_free(pool, ptr, 0, 0)
        rc, big = alloc(pool, 48 * MiB)
        assert rc == MP_OK
        expected = (32 + 32 + 48) * MiB if keep_idle else 48 * MiB
        assert core.mp_reserved_bytes(pool) == expected
        check(pool)
        core.mp_free(pool, big, 0, 0)
        assert core.mp_empty_cache(pool) == MP_OK
        assert core.mp_reserved_bytes(pool) == 0
        check(pool)
    finally:
        core.mp_pool_release(pool)


@pytest.mark.parametrize("keep_idle", [0, 1])
def test_out_of_memory_still_releases_and_retries(keep_idle):
    """On a 100 MiB device, 40 MiB idle and a 64 MiB request it cannot hold: both give the
    idle segment back and succeed. A pool that keeps idle does it only because the device
    refused (as PyTorch's allocator frees a pool's cached blocks before it reports out of
    memory), never to keep its footprint down."""
    cfg = default_config()
    cfg.keep_idle = keep_idle
    pool = make_pool(cfg, capacity=100 * MiB)
    try:
        rc, first = alloc(pool, 40 * MiB)
        assert rc == MP_OK
        core.mp_free(pool, first, 0, 0)
        rc, second = alloc(pool, 64 * MiB)
        assert rc == MP_OK and core.mp_reserved_bytes(pool) == 64 * MiB
        core.mp_free(pool, second, 0, 0)
        check(pool)
    finally:
        core.mp_pool_release(pool)


def test_over_a_limit_a_pool_that_keeps_idle_refuses_rather_than_releases():
    cfg = default_config()
    cfg.keep_idle = 1
    cfg.limit = 64 * MiB
    pool = make_pool(cfg)
    try:
        rc, first = alloc(pool, 32 * MiB)
        assert rc == MP_OK
        core.mp_free(pool, first, 0, 0)
        rc, _ = alloc(pool, 48 * MiB)
        assert rc == MP_ELIMIT
        assert core.mp_reserved_bytes(pool) == 32 * MiB
        check(pool)
    finally:
        core.mp_pool_release(pool)


def test_the_ctypes_mirror_of_mp_config_follows_the_header():
    """tests/_core_config.py: a field added to mp_config and not to the mirror would let the
    core write past the struct the tests hand it."""
    import os
    import re
    header = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "mempool", "_csrc", "core", "mp_core.h")
    with open(header) as f:
        text = f.read()
    body = text[text.index("typedef struct mp_config {"):text.index("} mp_config;")]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = re.findall(r"\b(\w+)(?:\[\w+\])?;", body)
    assert names == [name for name, _ in Config._fields_]
