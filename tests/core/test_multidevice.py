"""Several devices in one process, on simulated devices: one pool per device, each in its own
address window; peer access recorded by the simulated device; PyTorch's entry points routing
each device argument to its own pool; default_pool per device; per-pool accounting.

ctypes calls the torch entry points without the GIL, as PyTorch does.
"""
import ctypes
import os
import random
import subprocess
import sys
import threading

import pytest

import mempool
import mempool.torch as mt
from mempool import _core

from _support import BASE, GiB, MiB

SPAN = _core.SIM_DEVICE_SPAN
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ep = _core._torch_entry_points()
t_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                           ctypes.c_void_p)(_ep["alloc"])
t_free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                          ctypes.c_void_p)(_ep["free"])
t_record_stream = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(_ep["record_stream"])
t_reset = ctypes.CFUNCTYPE(None)(_ep["reset"])
t_memory_fraction = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(_ep["memory_fraction"])
t_base_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_size_t))(_ep["base_alloc"])


def window(device):
    """[first, end) of the addresses of simulated device `device`."""
    return BASE + device * SPAN, BASE + (device + 1) * SPAN


def sim_on(device, **options):
    options.setdefault("capacity", "4GiB")
    return mempool.Pool(backend="sim", device=device, **options)


@pytest.fixture
def devices():
    """A factory of sim pools registered with the torch table on their own device; the
    registrations are undone and every pool's invariants checked after the test."""
    made = []

    def make(*ordinals, **options):
        pools = []
        for d in ordinals:
            pool = sim_on(d, **options)
            _core._torch_register(d, pool)
            made.append((d, pool))
            pools.append(pool)
        return pools

    yield make
    for d, pool in made:
        try:
            _core._torch_unregister(d)
        except RuntimeError:
            pass
        pool.check_invariants()


def frozen(pool):
    """Everything observable about a pool's accounting, for 'did not move' checks."""
    return pool.stats(), pool.layout(), pool.device.counters()


# ---- simulated devices ------------------------------------------------------------------------

@pytest.mark.parametrize("device", [0, 1, 5, 63])
@pytest.mark.parametrize("expandable", [False, True])
def test_each_simulated_device_hands_out_its_own_addresses(device, expandable):
    pool = sim_on(device, expandable_segments=expandable)
    assert pool.device_id == device
    ptr = pool.alloc(MiB)
    assert ptr == BASE + device * SPAN           # exact: the window's first address
    assert pool.layout()[0]["address"] == ptr
    pool.free(ptr)
    pool.check_invariants()


@pytest.mark.parametrize("device", [64, 1000])
def test_a_simulated_device_outside_the_range_is_refused(device):
    with pytest.raises(ValueError, match=rf"device must be a simulated device ordinal in "
                                         rf"\[0, 64\) for backend 'sim', got {device}"):
        mempool.Pool(backend="sim", device=device)
    with pytest.raises(ValueError, match=rf"got {device}"):
        mempool.Pool.from_conf(f"backend:sim,device:{device}")


def test_initial_pool_size_lands_in_the_device_window():
    pool = sim_on(3, initial_pool_size="64MiB")
    seg = pool.layout()[0]
    assert seg["address"] == window(3)[0] and seg["is_pinned"]
    pool.check_invariants()


def test_pools_on_different_devices_never_share_an_address():
    rng = random.Random(7)
    pools = [sim_on(d, capacity="16GiB", expandable_segments=d % 2 == 1) for d in range(4)]
    spans = []
    for _ in range(200):
        d = rng.randrange(4)
        n = rng.choice([512, 4096, MiB, 3 * MiB, 12 * MiB])
        ptr = pools[d].alloc(n)
        lo, hi = window(d)
        assert lo <= ptr < hi
        spans.append((ptr, ptr + pools[d].block_info(ptr)[0], d))
    spans.sort()
    for (a0, a1, da), (b0, b1, db) in zip(spans, spans[1:]):
        assert a1 <= b0, f"blocks of devices {da} and {db} overlap"
    for p in pools:
        p.check_invariants()


def test_the_accounting_of_one_pool_never_moves_when_another_allocates():
    pools = [sim_on(d) for d in range(3)]
    rng = random.Random(11)
    live = {d: [] for d in range(3)}
    for _ in range(150):
        d = rng.randrange(3)
        others = {o: frozen(pools[o]) for o in range(3) if o != d}
        if live[d] and rng.random() < 0.4:
            pools[d].free(live[d].pop(rng.randrange(len(live[d]))))
        else:
            live[d].append(pools[d].alloc(rng.choice([512, 64 << 10, 2 * MiB, 30 * MiB])))
        for o, before in others.items():
            assert frozen(pools[o]) == before, f"pool of device {o} moved when {d} worked"
        pools[d].check_invariants()
    for d in range(3):
        assert pools[d].stats()["allocation.all.current"] == len(live[d])


# ---- peer access on the simulated device ------------------------------------------------------

def test_peer_access_covers_blocks_made_before_and_after():
    pool = sim_on(0)
    before = pool.alloc(MiB)
    assert pool.peer_devices() == () and pool.access_devices(before) == (0,)
    pool.enable_peer_access(1)
    after = pool.alloc(40 * MiB)                 # a new segment
    assert pool.peer_devices() == (1,)
    assert pool.access_devices(before) == (0, 1)
    assert pool.access_devices(after) == (0, 1)
    pool.free(before)
    pool.free(after)
    pool.check_invariants()


def test_expandable_pages_mapped_before_and_after_enabling_get_the_peer():
    pool = sim_on(2, expandable_segments=True, granularity="2MiB")
    early = pool.alloc(3 * MiB)                  # maps two pages
    assert pool.access_devices(early) == (2,)
    pool.enable_peer_access(5)
    assert pool.access_devices(early) == (2, 5)  # the pages mapped before: granted
    maps = pool.device.counters()["maps"]
    late = pool.alloc(9 * MiB)                   # grows the segment: new pages
    assert pool.device.counters()["maps"] > maps
    assert pool.access_devices(late) == (2, 5)   # the pages mapped after: granted at map
    pool.free(early)
    pool.free(late)
    pool.empty_cache()                           # unmaps everything
    assert pool.reserved_bytes() == 0
    again = pool.alloc(MiB)                      # re-mapped pages
    assert pool.access_devices(again) == (2, 5)
    pool.enable_peer_access(7)
    assert pool.access_devices(again) == (2, 5, 7)
    pool.free(again)
    pool.check_invariants()


def test_peer_access_is_per_pool():
    a, b = sim_on(0), sim_on(0)
    pa, pb = a.alloc(MiB), b.alloc(MiB)
    a.enable_peer_access(3)
    assert a.peer_devices() == (3,) and b.peer_devices() == ()
    assert b.access_devices(pb) == (0,)
    assert a.access_devices(pa) == (0, 3)


def test_enabling_is_idempotent_and_listed_in_order():
    pool = sim_on(4)
    for peer in (6, 1, 6, 63, 1, 0):
        pool.enable_peer_access(peer)
    assert pool.peer_devices() == (0, 1, 6, 63)


def test_an_index_type_is_a_peer():
    np = pytest.importorskip("numpy")
    pool = sim_on(0)
    pool.enable_peer_access(np.int64(2))
    assert pool.peer_devices() == (2,)


@pytest.mark.parametrize("peer, error, words", [
    (-1, ValueError, "peer_device must be a device ordinal >= 0, got -1"),
    (3, ValueError, "peer_device 3 is the pool's own device"),
    (64, ValueError, r"peer_device must be a simulated device ordinal in \[0, 64\), got 64"),
    (2 ** 40, ValueError, "not a device ordinal"),
    (True, TypeError, "peer_device must be an int device ordinal, got bool True"),
    ("1", TypeError, "got str '1'"),
    (1.0, TypeError, "got float 1.0"),
    (None, TypeError, "got NoneType None"),
])
def test_a_bad_peer_is_refused_by_name_and_changes_nothing(peer, error, words):
    pool = sim_on(3, expandable_segments=True)
    pool.enable_peer_access(1)
    ptr = pool.alloc(5 * MiB)
    with pytest.raises(error, match=words):
        pool.enable_peer_access(peer)
    assert pool.peer_devices() == (1,)
    assert pool.access_devices(ptr) == (1, 3)


def test_host_pools_have_no_peers():
    pool = mempool.Pool(backend="host", capacity="64MiB")
    ptr = pool.alloc(4096)
    with pytest.raises(ValueError, match="backend 'host' allocates host memory"):
        pool.enable_peer_access(1)
    assert pool.peer_devices() == () and pool.access_devices(ptr) == ()
    pool.free(ptr)


def test_access_devices_wants_a_live_block():
    pool = sim_on(0)
    ptr = pool.alloc(4096)
    with pytest.raises(ValueError, match="not the start of a live block"):
        pool.access_devices(ptr + 512)
    pool.free(ptr)
    with pytest.raises(ValueError, match="not the start of a live block"):
        pool.access_devices(ptr)
    with pytest.raises(TypeError):
        pool.access_devices("0x1000")


# ---- PyTorch's entry points, several devices --------------------------------------------------

def test_each_device_argument_reaches_its_own_pool(devices):
    pools = devices(0, 1, 2, 3)
    held = []
    for d in (2, 0, 3, 1, 1, 2):
        others = {o: frozen(pools[o]) for o in range(4) if o != d}
        ptr = t_alloc(3 * MiB, d, None)
        lo, hi = window(d)
        assert lo <= ptr < hi                     # device d's memory, nobody else's
        assert pools[d].block_info(ptr)[1] == 3 * MiB
        for o, before in others.items():
            assert frozen(pools[o]) == before
        held.append((ptr, d))
    for d in range(4):
        assert mt.counters(d)["live_blocks"] == sum(1 for _, e in held if e == d)
    for ptr, d in held:
        others = {o: frozen(pools[o]) for o in range(4) if o != d}
        t_free(ptr, 3 * MiB, d, None)
        for o, before in others.items():
            assert frozen(pools[o]) == before
    assert all(p.used_bytes() == 0 for p in pools)
    assert all(mt.counters(d)["live_blocks"] == 0 for d in range(4))


def test_a_device_without_a_pool_is_refused_with_its_name(devices, capfd):
    (p0,) = devices(0)
    before = frozen(p0)
    assert t_alloc(MiB, 1, None) is None
    assert frozen(p0) == before                   # never served from another device's pool
    err = capfd.readouterr().err
    assert "torch allocation of 1048576 bytes on device 1 refused: no pool is registered for " \
           "device 1" in err
    assert "mempool.torch.install_all" in err
    assert t_alloc(MiB, 64, None) is None
    assert "devices are routed in [0, 64)" in capfd.readouterr().err


def test_record_stream_finds_the_block_on_its_own_device(devices):
    pools = devices(0, 1, 2)
    ptrs = [t_alloc(MiB, d, None) for d in range(3)]
    side = 0x7000
    pools[2].device.launch(side)                  # work on the side stream, not yet done
    t_record_stream(ptrs[2], side)
    t_free(ptrs[2], MiB, 2, None)
    states = [b["state"] for s in pools[2].layout() for b in s["blocks"]
              if b["address"] == ptrs[2]]
    assert states == [2]                          # pending on device 2's pool
    for d in (0, 1):                              # the other devices saw nothing of it
        assert pools[d].device.counters()["event_records"] == 0
        assert pools[d].used_bytes() == MiB
    pools[2].device.complete(side)
    again = t_alloc(MiB, 2, None)
    assert again == ptrs[2]                       # reusable once the side stream finished
    t_free(again, MiB, 2, None)
    for d in (0, 1):
        t_free(ptrs[d], MiB, d, None)


def test_base_alloc_finds_the_block_on_any_device(devices):
    devices(0, 1, 2)
    ptrs = {d: t_alloc((d + 1) * MiB, d, None) for d in range(3)}
    for d, ptr in ptrs.items():
        size = ctypes.c_size_t(0)
        assert t_base_alloc(ptr, ctypes.byref(size)) == ptr
        assert size.value == (d + 1) * MiB
    for d, ptr in ptrs.items():
        t_free(ptr, 0, d, None)


def test_memory_fraction_caps_only_its_device(devices):
    pools = devices(0, 1, capacity="1GiB")
    t_memory_fraction(0.25, 1)
    assert t_alloc(300 * MiB, 1, None) is None    # over 256 MiB on device 1
    ok = t_alloc(300 * MiB, 0, None)              # device 0 is not capped
    assert ok
    assert pools[0].stats()["num_ooms"] == 0 and pools[1].stats()["num_ooms"] == 1
    t_free(ok, 300 * MiB, 0, None)


def test_reset_empties_every_device(devices):
    pools = devices(0, 1, 2)
    for d in range(3):
        t_free(t_alloc(8 * MiB, d, None), 8 * MiB, d, None)
    assert all(p.cached_bytes() > 0 for p in pools)
    t_reset()
    assert all(p.reserved_bytes() == 0 for p in pools)


def test_threads_on_different_devices_keep_exact_accounting(devices):
    pools = devices(0, 1, 2, 3)
    rounds = 400
    failures = []

    def work(d):
        rng = random.Random(d)
        held = []
        try:
            for _ in range(rounds):
                if held and rng.random() < 0.5:
                    ptr, n = held.pop()
                    t_free(ptr, n, d, None)
                else:
                    n = rng.choice([512, 8192, MiB, 5 * MiB])
                    ptr = t_alloc(n, d, None)
                    lo, hi = window(d)
                    if not ptr or not lo <= ptr < hi:
                        failures.append((d, ptr))
                        return
                    held.append((ptr, n))
            for ptr, n in held:
                t_free(ptr, n, d, None)
        except Exception as exc:   # reported below; a thread cannot fail the test itself
            failures.append((d, exc))

    threads = [threading.Thread(target=work, args=(d,)) for d in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    for d, pool in enumerate(pools):
        st = pool.stats()
        assert st["allocation.all.allocated"] == st["allocation.all.freed"] > 0
        assert pool.used_bytes() == 0 and mt.counters(d)["live_blocks"] == 0


# ---- default_pool per device ------------------------------------------------------------------

@pytest.fixture
def fresh_default_pools(monkeypatch):
    monkeypatch.setattr(mempool, "_default_pools", {})
    return monkeypatch


def test_default_pool_is_one_per_device_from_mempool_conf(fresh_default_pools):
    fresh_default_pools.setenv("MEMPOOL_CONF", "backend:sim,capacity:2GiB,"
                                               "expandable_segments:True")
    pools = [mempool.default_pool(d) for d in range(3)]
    assert [p.device_id for p in pools] == [0, 1, 2]
    assert [mempool.default_pool(d) for d in range(3)] == pools          # the same objects
    assert all(p.capacity == 2 * GiB and p.options["expandable_segments"] for p in pools)
    before = frozen(pools[0]), frozen(pools[2])
    ptr = pools[1].alloc(MiB)
    assert window(1)[0] <= ptr < window(1)[1]
    assert (frozen(pools[0]), frozen(pools[2])) == before
    pools[1].enable_peer_access(0)
    assert pools[1].peer_devices() == (0,) and pools[0].peer_devices() == ()
    pools[1].free(ptr)


# ---- install_all: checked before anything is registered ---------------------------------------

def test_install_all_refuses_a_pool_under_another_device():
    before = mt.routed_devices()
    with pytest.raises(ValueError, match=r"pools\[1\]: this pool allocates on device 0, so it "
                                         r"cannot serve device 1"):
        mt.install_all({0: sim_on(0), 1: sim_on(0)})
    assert mt.routed_devices() == before


@pytest.mark.parametrize("pools, error, words", [
    ({}, ValueError, "no pools given"),
    ([], ValueError, "no pools given"),
    ([None], TypeError, r"pools\[0\]: expected a mempool.Pool, got NoneType"),
    ({"0": None}, TypeError, "keys must be int device indices, got str '0'"),
    ({0: "pool"}, TypeError, r"pools\[0\]: expected a mempool.Pool, got str"),
    ({-1: None}, ValueError, r"-1 is outside \[0, 64\)"),
])
def test_install_all_checks_its_arguments(pools, error, words):
    before = mt.routed_devices()
    with pytest.raises(error, match=words):
        mt.install_all(pools)
    assert mt.routed_devices() == before


def test_install_all_wants_a_bool_for_peer_access():
    with pytest.raises(TypeError, match="peer_access must be True or False, got 'yes'"):
        mt.install_all([sim_on(0)], peer_access="yes")


def test_install_all_refuses_two_pools_for_one_device():
    with pytest.raises(ValueError, match="two pools for device 2; one pool per device"):
        mt.install_all([sim_on(2), sim_on(1), sim_on(2)])


def test_install_all_wants_device_memory():
    with pytest.raises(ValueError, match=r"pools\[1\]: PyTorch needs device memory; this pool's "
                                         r"backend is 'sim'"):
        mt.install_all([sim_on(1)])


def test_routed_devices_lists_the_registered_devices(devices):
    devices(2, 0, 5)
    assert mt.routed_devices() == (0, 2, 5)


# ---- the DDP example, its CPU path ------------------------------------------------------------

def _gloo():
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_gloo_available()
    except ImportError:
        return False


@pytest.mark.skipif(not _gloo(), reason="needs PyTorch with torch.distributed (gloo)")
@pytest.mark.parametrize("procs, expandable", [(2, False), (3, True)])
def test_ddp_example_all_reduces_host_pool_buffers(procs, expandable):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--backend", "host", "--procs", str(procs), "--steps", "3"]
    if expandable:
        args.append("--expandable")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ddp_allreduce.py"),
                          *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    want = procs * (procs + 1) // 2
    for rank in range(procs):
        assert (f"rank {rank}: 4 all_reduces over gloo of 65536 floats from a host pool = "
                f"{want} each; pool allocations 4, frees 4, used 0") in out.stdout
    # NCCL's settings are named only on cuda, where NCCL runs (the header of a gloo run).
    assert out.stdout.startswith(f"backend: host; {procs} processes over gloo\n"), out.stdout
    assert "NCCL" not in out.stdout and "all ranks agree" in out.stdout
