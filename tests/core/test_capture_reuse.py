"""Note [Capture reuse] (mempool/_csrc/core/mp_stream.c) on the simulated device, whose
streams keep a capture's graph (Note [Sim capture graphs] in mp_sim.c): with
graph_capture_record_stream_reuse, a block freed during a capture with a recorded stream is
reused within the capture once the capture orders every use before the request, as
PyTorch's allocator does; without the option, or before the streams join, it waits for the
capture's end. No call the capture forbids is made either way."""
import pytest

import mempool
from _support import MiB
from _support import device_counters as device

S, T = 11, 22   # S captures; T is a side stream that joins S's capture

UNSAFE = ("syncs", "stream_queries", "frees", "unmaps", "event_records")


def states(pool):
    """{address: state} of every block (0 free, 1 allocated, 2 pending)."""
    return {b["address"]: b["state"] for s in pool.layout() for b in s["blocks"]}


def fork_use_free(pool):
    """The multi-stream pattern of PyTorch's test_graph_capture_reclaim_*: S captures, T
    joins (side.wait_stream(main)), uses a block of S's (record_stream), and S frees it.
    Returns the block."""
    dev = pool.device
    dev.begin_capture(S)
    dev.launch(S)                       # the capture's first node: the block's producer
    a = pool.alloc(MiB, stream=S)
    dev.capture_join(T, S)              # T joins the capture after S's work
    pool.record_stream(a, T)
    dev.launch(T)                       # T's kernel reads the block
    pool.free(a, stream=S)              # pending: T's use is not ordered before S's next work
    return a


@pytest.mark.parametrize("reuse", [False, True])
def test_a_recorded_block_waits_until_the_streams_join(sim, reuse):
    pool = sim(graph_capture_record_stream_reuse=reuse)
    dev = pool.device
    before = device(pool, *UNSAFE)
    a = fork_use_free(pool)
    assert states(pool)[a] == 2
    b = pool.alloc(MiB, stream=S)       # T has not joined back: a cannot be taken yet
    assert b != a and states(pool)[a] == 2
    dev.capture_join(S, T)              # main.wait_stream(side)
    c = pool.alloc(MiB, stream=S)
    pool.check_invariants()
    if reuse:
        assert c == a                   # the graph orders T's use before c's work
    else:
        assert c not in (a, b) and states(pool)[a] == 2
    assert device(pool, *UNSAFE) == before and dev.capture_violations == 0
    for p in (b, c):
        pool.free(p, stream=S)
    dev.end_capture(S)
    pool.alloc(MiB, stream=S)           # the capture is over: deferred frees complete
    pool.check_invariants()
    assert dev.capture_violations == 0


def test_only_the_blocks_own_stream_takes_it_and_later_work_does_not_count(sim):
    """A request on T (the recorded stream) does not take S's block: it would go to S's free
    list. Work T captures after joining S does not order anything new for S."""
    pool = sim(graph_capture_record_stream_reuse=True)
    dev = pool.device
    a = fork_use_free(pool)
    t = pool.alloc(MiB, stream=T)
    assert t != a and states(pool)[a] == 2
    dev.launch(T)                       # more work on T: S has still not waited for it
    assert pool.alloc(MiB, stream=S) != a and states(pool)[a] == 2
    dev.capture_join(S, T)
    dev.launch(S)
    assert pool.alloc(MiB, stream=S) == a
    pool.check_invariants()
    dev.end_capture(S)
    assert dev.capture_violations == 0


def test_a_use_outside_the_capture_waits_for_its_end(sim):
    """A recorded stream that is not part of the capture ran its work outside the graph: the
    graph cannot order it, so the free waits for the capture's end (as PyTorch)."""
    pool = sim(graph_capture_record_stream_reuse=True)
    dev = pool.device
    a = pool.alloc(MiB, stream=S)
    pool.record_stream(a, T)
    dev.launch(T)
    dev.begin_capture(S)
    dev.launch(S)
    pool.free(a, stream=S)
    dev.launch(S)
    assert pool.alloc(MiB, stream=S) != a and states(pool)[a] == 2
    dev.end_capture(S)
    dev.complete_all()
    pool.alloc(MiB, stream=S)           # events now, and T's work has run
    pool.check_invariants()
    assert states(pool)[a] != 2
    assert dev.capture_violations == 0


def test_the_setting_changes_at_run_time_and_is_checked(sim):
    pool = sim()
    assert pool.options["graph_capture_record_stream_reuse"] is False
    with pytest.raises(TypeError, match="'enabled' must be True or False"):
        pool.set_capture_reuse(1)
    assert pool.options["graph_capture_record_stream_reuse"] is False
    pool.set_capture_reuse(True)
    assert pool.options["graph_capture_record_stream_reuse"] is True
    a = fork_use_free(pool)
    pool.device.capture_join(S, T)
    assert pool.alloc(MiB, stream=S) == a
    pool.device.end_capture(S)
    with pytest.raises(ValueError, match="graph_capture_record_stream_reuse"):
        mempool.Pool(backend="sim", graph_capture_record_stream_reuse="sometimes")
    conf = mempool.Pool.from_conf("backend:sim,graph_capture_record_stream_reuse:True")
    assert conf.options["graph_capture_record_stream_reuse"] is True


def test_the_simulated_graph_orders_what_joins(sim):
    """capture_join's rules: the other stream must capture, in the same capture."""
    pool = sim()
    dev = pool.device
    with pytest.raises(ValueError, match="capture_join"):
        dev.capture_join(T, S)          # S does not capture
    dev.begin_capture(S)
    with pytest.raises(ValueError, match="capture_join"):
        dev.capture_join(0, S)
    dev.capture_join(T, S)
    assert dev.is_capturing(T)
    dev.begin_capture(33)
    with pytest.raises(ValueError, match="capture_join"):
        dev.capture_join(T, 33)         # another capture
    dev.end_capture(33)
    dev.end_capture(S)
    assert not dev.is_capturing(T)      # it ended with the capture it joined
    assert dev.capture_violations == 0


def test_with_three_side_streams_every_one_must_have_joined(sim):
    """PyTorch's test_graph_capture_reclaim_4_streams: the block is read on three side
    streams; joining two of them back is not enough."""
    pool = sim(graph_capture_record_stream_reuse=True)
    dev = pool.device
    sides = (22, 33, 44)
    dev.begin_capture(S)
    dev.launch(S)
    a = pool.alloc(MiB, stream=S)
    for side in sides:
        dev.capture_join(side, S)
        pool.record_stream(a, side)
        dev.launch(side)
    pool.free(a, stream=S)
    for side in sides[:2]:
        dev.capture_join(S, side)
        dev.launch(S)
        b = pool.alloc(MiB, stream=S)
        assert b != a and states(pool)[a] == 2
        pool.free(b, stream=S)
    dev.capture_join(S, sides[2])
    assert pool.alloc(MiB, stream=S) == a
    pool.check_invariants()
    dev.end_capture(S)
    assert dev.capture_violations == 0 and not any(dev.is_capturing(s) for s in sides)


def test_one_walk_decides_each_block_on_its_own(sim):
    """Two blocks pending on S, one read on T and one on U: once S has waited for T only,
    T's block is reused and U's still waits (one walk of the graph answers for both)."""
    pool = sim(graph_capture_record_stream_reuse=True)
    dev = pool.device
    U = 44
    dev.begin_capture(S)
    dev.launch(S)
    a, c = pool.alloc(MiB, stream=S), pool.alloc(2 * MiB, stream=S)
    for side, block in ((T, a), (U, c)):
        dev.capture_join(side, S)
        pool.record_stream(block, side)
        dev.launch(side)
        pool.free(block, stream=S)
    dev.capture_join(S, T)
    dev.launch(S)
    assert pool.alloc(MiB, stream=S) == a
    assert states(pool)[c] == 2
    dev.capture_join(S, U)
    assert pool.alloc(2 * MiB, stream=S) == c
    pool.check_invariants()
    dev.end_capture(S)
    assert dev.capture_violations == 0
