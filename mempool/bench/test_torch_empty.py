"""``torch.empty`` through mempool's pluggable allocator against PyTorch's own caching
allocator, each in a fresh process (mempool/bench/torch_empty_child.py says why), by size.

The figures are the children's own timings (the same loop shape and round count as the rest
of the suite), the best of REPEATS children per allocator run alternately;
pytest-benchmark's timer here sees one run of all the children and is not the figure of
record (``extra_info["measured_in"] == "subprocess"``).
"""
import functools
import json
import os
import subprocess
import sys

import pytest

from .benchkit import GPU_MARKS, ROUNDS, SIZES, child_env, pairs_for

pytestmark = GPU_MARKS
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_empty_child.py")
ROWS = {"caching": "torch.empty, PyTorch caching allocator (own process)",
        "mempool": "torch.empty through mempool.torch.install (own process)"}


#: Child processes per allocator, run alternately: a child's pace depends on the machine
#: as it starts (one may run pure Python at half speed inside the full suite while its
#: neighbour does not), so each allocator's figure
#: is the best of its children and every child's figures are kept.
REPEATS = 3


def run_child(allocator, rounds, pairs):
    """One child's figures for every size."""
    env = child_env()
    done = subprocess.run([sys.executable, CHILD, allocator, str(rounds), str(pairs),
                           *map(str, SIZES.values())],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def run_children(rounds, pairs, repeats):
    """{allocator: [child result, ...]}, the allocators' children alternating."""
    results = {allocator: [] for allocator in ROWS}
    for _ in range(repeats):
        for allocator in ROWS:
            results[allocator].append(run_child(allocator, rounds, pairs))
    return results


@pytest.mark.parametrize("column", list(SIZES))
@pytest.mark.parametrize("allocator", list(ROWS))
def test_torch_empty(benchmark, allocator, column):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    pairs = pairs_for(benchmark)
    rounds = ROUNDS if not benchmark.disabled else 1
    repeats = REPEATS if not benchmark.disabled else 1
    children = benchmark.pedantic(run_children, args=(rounds, pairs, repeats), rounds=1,
                                  iterations=1)[allocator]
    if allocator == "mempool":
        for result in children:
            # Every tensor went through the pool: warm-up and timed rounds, each size.
            assert result["pool_allocations"] >= (rounds + 1) * pairs * len(SIZES)
    if benchmark.disabled:
        return
    figures = [result[str(SIZES[column])] for result in children]
    result = min(children, key=lambda r: r[str(SIZES[column])]["ns_per_pair"])
    figure = result[str(SIZES[column])]
    benchmark.group = f"torch.empty {column}"
    benchmark.extra_info.update(section="torch.empty", row=ROWS[allocator], column=column,
                                unit="pair", measured_in="subprocess", nbytes=SIZES[column],
                                ref=0 if allocator == "mempool" else None,
                                order=list(SIZES).index(column), ns=figure["ns_per_pair"],
                                ns_per_pair=figure["ns_per_pair"],
                                min_ns_per_pair=figure["min_ns_per_pair"],
                                child_context=result["context"],
                                pool_counters=result.get("pool_counters"),
                                children_ns_per_pair=[f["ns_per_pair"] for f in figures],
                                children_context=[r["context"] for r in children])

