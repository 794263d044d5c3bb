"""The foundation's targets, on the simulated device (CPU only; they run in CI).

- ``floor``: the 512 B alloc+free round trip from Python against two bare calls of a
  cdef-class method (``free(alloc(n))`` has the shape of two calls), in the same run. The
  gap is what the pool costs beyond calling into compiled code at all.
- ``populated``: the same round trip in a pool holding 100,000 live blocks and 10,000
  cached free blocks of assorted sizes, against a fresh pool. The cached blocks are every
  11th of 110,000 allocated in order, so no two are neighbours and none merge away.
"""
import pytest

from .benchkit import SIZES, log_uniform_sizes, measure
from .contenders import BY_ID, mempool_cloop, mempool_raw

N_LIVE, N_CACHED = 100_000, 10_000
ASSORTED = (512, 2 << 20)   # small-list and large-list sizes both


@pytest.mark.parametrize("size", ["512 B", "64 KiB"], ids=["512B", "64KiB"])
def test_sim_floor(benchmark, pairs, size):
    """The floor beside the round trips below (the size is only passed through)."""
    entry = BY_ID["floor"]
    with entry.open() as contender:
        measure(benchmark, contender.fixed_loop(SIZES[size]), pairs, section="foundation",
                row=entry.label, column=size, order=SIZES[size], nbytes=SIZES[size])


def populate(pool):
    """Fill `pool` with N_LIVE live and N_CACHED cached free blocks; return the live ones."""
    sizes = log_uniform_sizes(N_LIVE + N_CACHED, *ASSORTED)
    ptrs = [pool.alloc(nbytes) for nbytes in sizes]
    for ptr in ptrs[::11]:
        pool.free(ptr)
    live = [p for i, p in enumerate(ptrs) if i % 11]
    assert len(live) == N_LIVE
    return live


@pytest.mark.parametrize("loop", ["python", "cloop"])
@pytest.mark.parametrize("size", ["512 B", "64 KiB"], ids=["512B", "64KiB"])
@pytest.mark.parametrize("state", ["empty", "populated"])
def test_sim_roundtrip_populated(benchmark, pairs, state, size, loop):
    factory = mempool_raw if loop == "python" else mempool_cloop
    contender = factory("sim")
    pool = contender.alloc.__self__
    live = populate(pool) if state == "populated" else []
    try:
        stats = pool.stats()
        assert stats["allocation.all.current"] == len(live)
        label = "mempool alloc/free (sim)" if loop == "python" else "mempool C loop (sim)"
        label += ", 100k live + 10k cached" if live else ", empty pool"
        measure(benchmark, contender.fixed_loop(SIZES[size]), pairs, section="foundation",
                row=label, column=size, order=SIZES[size],
                ref=1 if loop == "python" and not live else None, backend="sim",
                nbytes=SIZES[size], live_blocks=len(live),
                cached_bytes=pool.cached_bytes(),
                inactive_split=stats.get("inactive_split.all.current"))
        assert pool.stats()["allocation.all.current"] == len(live)
        pool.check_invariants()
    finally:
        for ptr in live:
            pool.free(ptr)
        contender.close()
