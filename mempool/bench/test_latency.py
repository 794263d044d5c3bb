"""Allocation latency: one malloc+free pair, by allocator and size, side by side.

Each row of contenders.LATENCY runs at 512 B, 64 KiB, 1 MiB and 64 MiB, and on a seeded
log-uniform mix of 512 B-256 MiB with MIX_LIVE blocks live (each step allocates one block and
frees the one allocated MIX_LIVE steps before). The pytest-benchmark group is the size, so
pytest-benchmark's own tables compare the allocators within one size.
"""
import pytest

from .benchkit import (GPU_MARKS, MIX, MIX_LIVE, MIX_MAX, MIX_MIN, SIZES, log_uniform_sizes,
                       measure)
from .contenders import LATENCY

COLUMNS = {**{label.replace(" ", ""): label for label in SIZES}, "mix": MIX}
ENTRIES = [pytest.param(e, id=e.cid, marks=GPU_MARKS if e.gpu else ()) for e in LATENCY]


@pytest.mark.parametrize("column", [pytest.param(c, id=cid) for cid, c in COLUMNS.items()])
@pytest.mark.parametrize("entry", ENTRIES)
def test_pair(benchmark, pairs, entry, column):
    with entry.open() as contender:
        if column == MIX:
            sizes = log_uniform_sizes(pairs, MIX_MIN, MIX_MAX)
            loop = contender.mix_loop(sizes, MIX_LIVE)
            nbytes = None
        else:
            nbytes = SIZES[column]
            loop = contender.fixed_loop(nbytes)
        measure(benchmark, loop, pairs, section="latency", row=entry.label, column=column,
                group=f"latency {column}", order=list(COLUMNS.values()).index(column),
                ref=entry.ref, backend=entry.backend,
                nbytes=nbytes)
        benchmark.extra_info.update(contender.info())
        contender.release()
        contender.check()
