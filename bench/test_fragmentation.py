"""The fragmentation benchmark as a report test: ``pytest bench/test_fragmentation.py -s``.

Replays the shipped training traces on sim under the settings of bench/fragmentation.py,
prints the table and checks the figures are consistent and deterministic (those checks
gate). The targets (peak reserved / peak live at most 1.02 with expandable segments, 1.10
without) are reported, not gated, as benchmarks are: a missed target shows as an expected
failure whose message gives the measured ratio.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fragmentation  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    rows = fragmentation.run()
    print()
    print(fragmentation.table(rows))
    return rows


def _row(rows, trace, setting):
    return next(r for r in rows if r["trace"] == trace and r["setting"] == setting)


def test_every_trace_and_setting_replayed(rows):
    assert len(rows) == len(fragmentation.TRACES) * len(fragmentation.SETTINGS)
    for r in rows:
        if "skipped" in r:
            assert r["options"], "the default configuration must replay"
            continue
        assert r["num_ooms"] == 0
        assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"] >= r["peak_live_bytes"] > 0


def test_figures_are_deterministic(rows):
    again = fragmentation.run()
    strip = [{k: v for k, v in r.items() if k != "ns_per_event"} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k != "ns_per_event"} for r in again]


@pytest.mark.parametrize("trace", fragmentation.TRACES)
@pytest.mark.parametrize("setting", [label for label, _ in fragmentation.SETTINGS])
def test_target(rows, trace, setting):
    r = _row(rows, trace, setting)
    if "skipped" in r:
        pytest.skip(r["skipped"])
    if setting == "max_split_size:64MB":
        # max_split_size trades memory for bounded fragmentation on long runs; PyTorch
        # measures 3.04 with it on the transformer loop. No target: it is reported.
        assert r["ratio"] < 3.044
        return
    if r["ratio"] > r["target"]:
        pytest.xfail(f"{trace} under {setting}: peak reserved / peak live = {r['ratio']:.3f}, "
                     f"target {r['target']:.2f}")
    assert r["ratio"] <= r["target"]
