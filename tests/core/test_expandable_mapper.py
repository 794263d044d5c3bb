"""map_ahead: the mapper thread of an expandable pool (Note [Mapper] in
mempool/_csrc/core/mp_expand_mapper.c) keeps free pages mapped ahead of each growing range's
edge and does the release threshold's unmapping behind it, off the allocating thread.

The pools here map one physical allocation per page (max_map_size = the page), the fine
setting the mapper exists for; _mapper_wait_idle makes every check deterministic."""
import os
import random
import threading
import time
import warnings

import pytest

import mempool
from mempool import _conf_parse

from _support import GiB, MiB

FREE, ALLOCATED, PENDING, UNMAPPED = 0, 1, 2, 3
FINE = {"expandable_segments": True, "max_map_size": 2 * MiB}


def edge_stock(pool, index=0):
    """The free bytes mapped at the end of range `index`, before its unmapped tail."""
    blocks = pool.layout()[index]["blocks"]
    assert blocks[-1]["state"] == UNMAPPED
    return blocks[-2]["size"] if len(blocks) > 1 and blocks[-2]["state"] == FREE else 0


def settled(pool):
    pool._mapper_wait_idle()
    return pool.stats()


@pytest.mark.parametrize("backend", ["sim", "host"])
def test_stock_appears_at_the_edge_after_a_growth_there(backend, sim, host):
    pool = (sim if backend == "sim" else host)(capacity=GiB, map_ahead=16 * MiB, **FINE)
    a = pool.alloc(3 * MiB)
    st = settled(pool)
    assert edge_stock(pool) >= 16 * MiB
    assert st["num_ahead_maps"] == 8 and st["num_device_alloc"] == 2 + 8   # one a page
    assert pool.reserved_bytes() == 4 * MiB + 16 * MiB
    pool.free(a)


def test_without_map_ahead_nothing_is_stocked(sim):
    pool = sim(capacity=GiB, **FINE)
    a = pool.alloc(3 * MiB)
    st = settled(pool)
    assert edge_stock(pool) == 1 * MiB and st["num_ahead_maps"] == 0
    assert pool.options["map_ahead"] is None
    pool.free(a)


def test_allocations_from_stock_make_no_map_and_a_low_edge_is_refilled(sim):
    pool = sim(capacity=GiB, map_ahead=16 * MiB, **FINE)
    dev = pool.device
    a = pool.alloc(3 * MiB)
    settled(pool)
    maps = dev.counters()["maps"]
    b = pool.alloc(6 * MiB)                     # 17 MiB of stock: 11 left, above half
    assert dev.counters()["maps"] == maps
    st = settled(pool)
    assert dev.counters()["maps"] == maps and st["num_ahead_maps"] == 8
    c = pool.alloc(4 * MiB)                     # 7 MiB left, below half: refilled behind it
    assert dev.counters()["maps"] == maps
    settled(pool)
    assert edge_stock(pool) >= 16 * MiB and dev.counters()["maps"] > maps
    for p in (a, b, c):
        pool.free(p)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and dev.counters()["live_maps"] == 0


def test_the_growth_is_off_the_allocating_thread(sim):
    """With the driver's time modelled, an allocation served from stock waits for no map."""
    pool = sim(capacity=GiB, map_ahead=32 * MiB, **FINE)
    pool.device.set_call_delays(map_ns=200_000_000)   # 200 ms a map: unmistakable
    a = pool.alloc(2 * MiB)
    settled(pool)
    start = time.perf_counter()
    b = pool.alloc(8 * MiB)
    assert time.perf_counter() - start < 0.1
    pool.free(a)
    pool.free(b)


@pytest.mark.parametrize("extra", [{"limit": 24 * MiB},
                                   {"garbage_collection_threshold": 0.05},
                                   {"release_threshold": 8 * MiB}],
                         ids=["limit", "gc_threshold", "release_threshold"])
def test_stock_never_passes_the_bounds(sim, extra):
    pool = sim(capacity=GiB, map_ahead=64 * MiB, **FINE, **extra)
    a = pool.alloc(3 * MiB)
    st = settled(pool)
    peak = st["mapped_bytes.peak"]
    if "limit" in extra:
        assert peak <= 24 * MiB and pool.reserved_bytes() == 24 * MiB
    elif "garbage_collection_threshold" in extra:
        assert peak <= int(0.05 * GiB)
    else:
        cached = pool.reserved_bytes() - pool.stats()["active_bytes.all.current"]
        assert cached <= 8 * MiB
    assert st["num_ahead_maps"] > 0
    pool.free(a)


def test_nothing_is_stocked_during_a_capture(sim):
    pool = sim(capacity=GiB, map_ahead=16 * MiB, **FINE)
    dev = pool.device
    dev.begin_capture(7)
    a = pool.alloc(3 * MiB, stream=7)
    st = settled(pool)
    assert st["num_ahead_maps"] == 0 and edge_stock(pool) == 1 * MiB
    dev.end_capture(7)
    assert dev.capture_violations == 0
    pool.free(a)
    b = pool.alloc(6 * MiB, stream=7)           # a growth once the capture is over
    assert settled(pool)["num_ahead_maps"] > 0 and edge_stock(pool) >= 16 * MiB
    pool.free(b)


def test_the_threshold_unmaps_on_the_mapper(sim):
    pool = sim(capacity=GiB, map_ahead=8 * MiB, release_threshold=4 * MiB, **FINE)
    dev = pool.device
    a = pool.alloc(32 * MiB)
    settled(pool)
    dev.set_call_delays(unmap_ns=300_000_000)   # 300 ms an unmap: the free must not wait
    start = time.perf_counter()
    pool.free(a)
    assert time.perf_counter() - start < 0.15
    st = settled(pool)
    assert st["num_behind_unmaps"] > 0 and pool.reserved_bytes() <= 4 * MiB
    assert st["num_stream_syncs"] == 0          # queries, never a sync
    assert dev.counters()["mapped_bytes"] == pool.reserved_bytes()


def test_destroy_waits_out_a_map_in_flight():
    pool = mempool.Pool(backend="sim", capacity=GiB, map_ahead=64 * MiB, **FINE)
    pool.device.set_call_delays(map_ns=200_000_000)
    pool.alloc(3 * MiB)                        # its growth takes 200 ms, then the mapper's
    time.sleep(0.05)                            # the mapper is inside its first map
    start = time.perf_counter()
    pool.close(force=True)                      # destroy: joins the mapper after that map
    assert time.perf_counter() - start >= 0.1


def test_empty_cache_while_a_map_is_in_flight_keeps_the_accounting_exact(sim):
    """Stock landing while the pool empties: it stays as free pages, counted, until the
    next release."""
    pool = sim(capacity=GiB, map_ahead=64 * MiB, **FINE)
    dev = pool.device
    dev.set_call_delays(map_ns=2_000_000)
    a = pool.alloc(3 * MiB)
    pool.free(a)
    pool.empty_cache()                          # the mapper may still be mapping
    settled(pool)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and dev.counters()["live_maps"] == 0
    assert dev.counters()["maps"] == pool.stats()["num_device_alloc"]


def test_forget_stream_with_stock_present(sim):
    pool = sim(capacity=GiB, map_ahead=16 * MiB, **FINE)
    dev = pool.device
    a = pool.alloc(3 * MiB, stream=5)
    settled(pool)
    assert edge_stock(pool) >= 16 * MiB
    pool.free(a)
    pool.forget_stream(5)                       # only free pages of 5: the range goes
    settled(pool)
    assert pool.reserved_bytes() == 0 and dev.counters()["live_maps"] == 0
    b = pool.alloc(3 * MiB, stream=5)           # a new range, stocked again
    assert settled(pool)["num_ahead_maps"] == 16
    pool.free(b)


def test_forget_stream_while_a_map_is_in_flight(sim):
    pool = sim(capacity=GiB, map_ahead=16 * MiB, **FINE)
    pool.device.set_call_delays(map_ns=5_000_000)
    a = pool.alloc(3 * MiB, stream=5)
    pool.free(a)
    pool.forget_stream(5)
    settled(pool)
    pool.check_invariants()
    pool.empty_cache()
    assert pool.reserved_bytes() == 0


def test_views_and_releases_work_while_the_mapper_maps(sim):
    pool = sim(capacity=GiB, map_ahead=64 * MiB, release_threshold=32 * MiB, **FINE)
    pool.device.set_call_delays(map_ns=200_000, unmap_ns=200_000)
    for i in range(20):
        a = pool.alloc((i % 5 + 1) * MiB, stream=i % 2)
        pool.check_invariants()                 # a map of the mapper's may be in flight
        pool.layout()
        pool.snapshot()
        pool.trim(8 * MiB) if i % 3 else pool.empty_cache()
        pool.free(a)
    settled(pool)
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and pool.device.counters()["live_maps"] == 0


def test_a_forked_child_refuses_the_inherited_pool_and_stocks_its_own():
    pool = mempool.Pool(backend="sim", capacity=GiB, map_ahead=16 * MiB, **FINE)
    a = pool.alloc(3 * MiB)
    settled(pool)                               # the parent's mapper runs
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                pool._mapper_wait_idle()
            except RuntimeError as exc:
                if "forked child" in str(exc):
                    own = mempool.Pool(backend="sim", capacity=GiB, map_ahead=16 * MiB, **FINE)
                    b = own.alloc(3 * MiB)
                    own._mapper_wait_idle()
                    code = 0 if own.stats()["num_ahead_maps"] == 8 else 2
                    own.free(b)
                    own.close()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.001)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    b = pool.alloc(14 * MiB)                    # the parent's mapper works on
    settled(pool)
    assert edge_stock(pool) >= 16 * MiB
    for p in (a, b):
        pool.free(p)
    pool.check_invariants()
    pool.close()


def hammer(pool, stream, seed, rounds, errors):
    rnd = random.Random(seed)
    live = []
    try:
        for _ in range(rounds):
            if live and (rnd.random() < 0.45 or len(live) > 24):
                pool.free(live.pop(rnd.randrange(len(live))))
            else:
                live.append(pool.alloc(rnd.choice((rnd.randrange(1, 1 << 20),
                                                   rnd.randrange(1 << 20, 12 << 20))),
                                       stream=stream))
        for p in live:
            pool.free(p)
    except Exception as exc:   # reported by the test
        errors.append(repr(exc))


@pytest.mark.parametrize("threshold", [None, 16 * MiB])
def test_threads_allocating_on_several_streams_with_the_mapper(sim, threshold):
    pool = sim(capacity=4 * GiB, map_ahead=16 * MiB, release_threshold=threshold, **FINE)
    dev = pool.device
    dev.set_call_delays(map_ns=20_000, unmap_ns=20_000)
    errors = []
    threads = [threading.Thread(target=hammer, args=(pool, 1 + i % 3, i, 400, errors))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = settled(pool)
    pool.check_invariants()
    assert st["allocated_bytes.all.current"] == 0
    if threshold is None:   # under the threshold the stock may find no room
        assert st["num_ahead_maps"] > 0
    assert dev.counters()["mapped_bytes"] == pool.reserved_bytes()
    assert dev.counters()["maps"] == st["num_device_alloc"]
    assert dev.counters()["unmaps"] == st["num_device_free"]
    if threshold is not None:
        # A check that met pages in flight leaves them for the next one: one more free.
        pool.free(pool.alloc(512))
        settled(pool)
        assert pool.reserved_bytes() <= threshold and st["num_behind_unmaps"] > 0
    pool.empty_cache()
    assert pool.reserved_bytes() == 0 and dev.counters()["live_maps"] == 0


@pytest.mark.parametrize("bad", [-1, 0, True, "abc", 1.5, [], "-3MiB"])
def test_bad_map_ahead_is_refused_with_the_option_named(bad):
    with pytest.raises(ValueError, match="option 'map_ahead'.*accepted"):
        mempool.Pool(backend="sim", expandable_segments=True, map_ahead=bad)


def test_map_ahead_is_read_from_conf_strings_and_warned_of_without_expandable(monkeypatch):
    pool = mempool.Pool.from_conf("backend:sim,expandable_segments:true,map_ahead:64MiB")
    assert pool.options["map_ahead"] == 64 * MiB
    assert mempool.Pool.from_conf(
        "backend:sim,expandable_segments:true,map_ahead_mb:32").options["map_ahead"] == 32 * MiB
    monkeypatch.setattr(_conf_parse, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = mempool.Pool(backend="sim", map_ahead="64MiB")
    assert any(issubclass(w.category, mempool.ConfigWarning) and "map_ahead" in str(w.message)
               for w in caught)
    a = plain.alloc(3 * MiB)                    # fixed segments: no mapper, nothing stocked
    plain._mapper_wait_idle()
    assert plain.stats()["num_ahead_maps"] == 0
    plain.free(a)


def test_replay_takes_map_ahead_and_the_sim_delays():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trace = os.path.join(root, "mempool", "traces", "small.jsonl")
    out = subprocess.run(
        [sys.executable, "-m", "mempool", "replay", trace, "--conf",
         "expandable_segments:true,max_map_size:2MiB,map_ahead:16MiB", "--sim-delays", "1,1"],
        capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    assert "map_ahead:16MiB" in out.stdout and "mapper " in out.stdout
    from mempool.tools import replay as rp

    result = rp.replay(trace, conf="expandable_segments:true,max_map_size:2MiB,map_ahead:16MiB",
                       sim_delays_ns=(1000, 1000))
    assert result.stats["num_ahead_maps"] > 0
    assert result.stats["num_device_alloc"] == result.upstream["device_alloc"]
    with pytest.raises(ValueError, match="sim_delays_ns"):
        rp.replay(trace, backend="host", sim_delays_ns=(1, 1))
    for bad in (5, (1,), (1, 2, 3), "1,2"):
        with pytest.raises(ValueError, match=r"sim_delays_ns is \(map_ns, unmap_ns\)"):
            rp.replay(trace, sim_delays_ns=bad)
