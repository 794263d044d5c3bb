"""The stream contract on the simulated device, whose work completes only when told.

- A block freed on stream S serves S's next allocation at once (stream order makes it safe).
- Another stream T gets it only after S's work is complete, or through an event that T
  waits on (cross_stream_reuse, no host sync).
- A block declared with record_stream(ptr, U) returns to a free list only once U's work
  queued before the free has completed.
"""
import pytest

from _support import BASE, MiB

S, T, U = 11, 22, 33


def test_no_wait_when_the_owner_is_idle(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    pool.free(a)                                    # S has no work queued
    assert pool.alloc(4096, stream=T) == a
    assert pool.stats()["num_event_waits"] == 0     # nothing to order T after


def test_same_stream_reuse_is_immediate(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    pool.device.launch(S)                          # work using a, still pending
    pool.free(a)
    assert pool.alloc(4096, stream=S) == a
    assert pool.stats()["num_event_waits"] == 0
    assert pool.device.counters()["syncs"] == 0


def test_cross_stream_reuse_waits_on_an_event_not_the_host(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    seq = pool.device.launch(S)
    pool.free(a)
    b = pool.alloc(4096, stream=T)
    assert b == a                                   # taken over from S ...
    assert pool.device.ordered(T, S, seq)           # ... with T ordered after S's work
    assert pool.device.counters()["syncs"] == 0     # and no host sync
    assert pool.stats()["num_cross_stream_reuse"] == 1
    assert pool.block_info(b)[2] == T
    pool.free(b)


def test_cross_stream_reuse_off_takes_a_new_segment(sim):
    pool = sim(cross_stream_reuse=False)
    a = pool.alloc(4096, stream=S)
    pool.device.launch(S)
    pool.free(a)
    b = pool.alloc(4096, stream=T)
    assert b == BASE + 2 * MiB                       # a segment of T's own; S's idle one,
    assert pool.reserved_bytes() == 2 * MiB          # which T may not use, went back
    assert pool.stats()["num_event_waits"] == 0
    pool.free(b)


def test_own_stream_blocks_are_preferred_over_other_streams(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    pool.device.launch(S)
    b = pool.alloc(4096, stream=T)                  # T took it from busy S's segment: one wait
    assert pool.stats()["num_event_waits"] == 1
    pool.free(a)
    pool.free(b)
    assert pool.alloc(4096, stream=T) == b
    assert pool.alloc(4096, stream=S) == a
    assert pool.stats()["num_event_waits"] == 1      # no more


def test_remainder_of_a_taken_block_stays_with_its_stream(sim):
    pool = sim()
    a = pool.alloc(8192, stream=S)
    pool.free(a)                                    # S owns the whole 2 MiB segment again
    b = pool.alloc(1024, stream=T)
    assert b == a
    layout = pool.layout()[0]["blocks"]
    assert [(x["stream"], x["state"]) for x in layout] == [(T, 1), (S, 0)]
    pool.free(b)
    # different owners: the free neighbours do not merge
    layout = pool.layout()[0]["blocks"]
    assert [(x["stream"], x["state"], x["size"]) for x in layout] == [(T, 0, 1024), (S, 0, 2 * MiB - 1024)]


def test_record_stream_holds_the_block_until_that_stream_finishes(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    pool.record_stream(a, U)
    pool.device.launch(U)                           # U reads a
    pool.free(a)
    s = pool.stats()
    assert s["active.all.current"] == 1 and s["allocation.all.current"] == 0
    b = pool.alloc(4096, stream=S)
    assert b != a                                    # pending: not even S may have it
    pool.device.complete(U)
    c = pool.alloc(4096, stream=S)
    assert c == a
    for p in (b, c):
        pool.free(p)


def test_record_stream_on_the_owner_is_a_no_op(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    pool.record_stream(a, S)
    pool.free(a)
    assert pool.alloc(4096, stream=S) == a


def test_record_stream_of_several_streams_waits_for_all(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    for st in (T, U):
        pool.record_stream(a, st)
        pool.device.launch(st)
    pool.free(a)
    pool.device.complete(T)
    assert pool.alloc(4096, stream=S) != a
    pool.device.complete(U)
    assert pool.alloc(4096, stream=S) == a


def test_free_on_another_stream_moves_the_block_there(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    pool.device.launch(T)
    pool.free(a, stream=T)                           # last used on T
    assert pool.alloc(4096, stream=T) == a           # T may reuse it at once
    assert pool.stats()["num_event_waits"] == 0




def test_pending_memory_is_reclaimed_by_a_sync_before_oom(sim):
    pool = sim(capacity=20 * MiB)
    a = pool.alloc(12 * MiB, stream=S)               # 12 MiB segment
    pool.record_stream(a, U)
    pool.device.launch(U)
    pool.free(a)                                      # pending on U
    b = pool.alloc(12 * MiB, stream=S)               # device full: the pool syncs U
    assert b == a
    assert pool.stats()["num_sync_all_streams"] == 1
    assert pool.device.stream_info(U)["completed"] == 1
    pool.free(b)


@pytest.mark.parametrize("stream", [0, 1, 2, 2 ** 64 - 1])
def test_stream_handles(sim, stream):
    pool = sim()
    a = pool.alloc(512, stream=stream)
    assert pool.block_info(a)[2] == stream
    pool.free(a)


def test_stream_objects(sim):
    class CupyLike:
        ptr = 1234

    class TorchLike:
        cuda_stream = 4321

    class Protocol:
        def __cuda_stream__(self):
            return (0, 777)

    pool = sim()
    for obj, handle in ((CupyLike(), 1234), (TorchLike(), 4321), (Protocol(), 777)):
        a = pool.alloc(512, stream=obj)
        assert pool.block_info(a)[2] == handle
        pool.free(a, stream=obj)


def test_forget_stream_hands_everything_to_the_legacy_stream(sim):
    pool = sim()
    a = pool.alloc(4096, stream=S)
    b = pool.alloc(8192, stream=S)
    pool.record_stream(b, U)
    pool.device.launch(S)
    pool.free(a)
    syncs = pool.device.counters()["syncs"]
    pool.forget_stream(S)
    assert pool.device.counters()["syncs"] == syncs + 1           # S drained once
    assert pool.device.stream_info(S)["completed"] == 1
    owners = {blk["stream"] for seg in pool.layout() for blk in seg["blocks"]}
    assert owners == {0}
    assert {seg["stream"] for seg in pool.layout()} == {0}
    assert pool.block_info(b)[2] == 0
    assert pool.alloc(4096, stream=0) == a                        # legacy reuses it, no wait
    assert pool.stats()["num_event_waits"] == 0
    pool.free(b)
    pool.free(a)
    pool.forget_stream(S)                                         # again: nothing to do
    pool.forget_stream(0)

