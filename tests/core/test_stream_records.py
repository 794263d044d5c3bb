"""Streams without end (Note [Streams without end], mp_stream.c): a pool that sees stream
after stream, never told to forget one, keeps records only for the streams that hold
something, so its memory and the work of each operation do not grow with the streams it
has seen."""
import pytest

import mempool

STREAMS = 20_000
KEPT = 256        # a bound far below STREAMS: the sweep keeps at most twice what holds blocks


@pytest.mark.parametrize("options", [{}, {"expandable_segments": True}], ids=str)
def test_idle_streams_are_not_kept(options):
    pool = mempool.Pool(backend="sim", **options)
    for s in range(1, STREAMS + 1):
        pool.free(pool.alloc(64 << 10, stream=s))
        if s % 1000 == 0:
            assert pool.stats()["num_streams"] <= KEPT, f"after {s} streams"
    assert pool.stats()["num_streams"] <= KEPT
    pool.check_invariants()
    pool.empty_cache()
    assert pool.used_bytes() == 0


def test_recorded_streams_are_not_kept_once_the_free_completes():
    pool = mempool.Pool(backend="sim")
    for s in range(1, STREAMS + 1):
        ptr = pool.alloc(4096, stream=0)
        pool.record_stream(ptr, s)
        pool.device.launch(s)      # work on s: the free waits for it
        pool.free(ptr)
        pool.device.complete(s)
    pool.alloc(4096)               # polls the pending frees
    assert pool.stats()["num_streams"] <= KEPT
    pool.check_invariants()


def test_a_stream_holding_blocks_is_kept_and_forget_still_works():
    pool = mempool.Pool(backend="sim")
    held = pool.alloc(1 << 20, stream=7)
    for s in range(100, 100 + STREAMS // 4):
        pool.free(pool.alloc(512, stream=s))
    pool.free(held)
    pool.forget_stream(7)          # kept (it held a block), so forgotten as documented
    pool.forget_stream(100)        # long swept: a no-op
    pool.check_invariants()
    assert pool.stats()["num_streams"] <= KEPT
