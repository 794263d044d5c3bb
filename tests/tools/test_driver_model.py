"""bench/driver_model.py: the cudaMemPool model reproduces the H200 probe facts
(an earlier run (bench/results/ in git history)) and the six trace figures it was chosen on."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))
import driver_model as dm  # noqa: E402

MiB = dm.MiB
FIT = dm.CANDIDATES[dm.FITTING[0]]


held_after = dm.held_after


@pytest.mark.parametrize("label", dm.FITTING)
def test_the_fitting_models_reproduce_every_probe_fact(label):
    assert dm.check_probe_facts(**dm.CANDIDATES[label]) == []


@pytest.mark.parametrize("mib, held", [(1, 32), (20, 32), (32, 32), (34, 64), (100, 128),
                                       (200, 224)])
def test_one_allocation_holds_whole_chunks(mib, held):
    assert held_after([("alloc", 0, mib)], **FIT) == [held]


def test_a_run_of_one_size_holds_the_chunks_covering_its_total():
    assert held_after([("alloc", i, 12) for i in range(6)], **FIT) == [32, 32, 64, 64, 64, 96]
    assert held_after([("alloc", i, 6) for i in range(6)], **FIT)[4:] == [32, 64]


def test_a_freed_range_is_reused_by_a_larger_request():
    assert held_after([("alloc", 0, 32), ("free", 0, 0), ("alloc", 1, 64)], **FIT)[-1] == 64


def test_a_chunk_wholly_freed_stops_counting():
    m = dm.DriverModel(**FIT)
    m.alloc(0, 20 * MiB)
    m.alloc(1, 20 * MiB)      # straddles chunks 0 and 1
    m.free(0)
    assert m.held == 64 * MiB  # chunk 0 still holds part of segment 1
    m.free(1)
    assert m.held == 0 and m.peak == 64 * MiB


def test_kept_counts_the_chunks_freed_just_before_an_allocation_during_it():
    # Note [Released before a growth]: 64 MiB released for a 96 MiB segment none of its
    # range holds. Given back at once the device peaks at 32 + 96; kept behind a busy stream,
    # at 64 + 32 + 96. A freed range the allocation reuses counts once.
    seq = [("alloc", 0, 64 * MiB, 0), ("alloc", 1, 32 * MiB, 0), ("free", 0, 64 * MiB, 0),
           ("alloc", 2, 96 * MiB, 0)]
    assert dm.peak_held(seq, **FIT) == 128 * MiB
    assert dm.peak_held(seq, kept=True, **FIT) == 192 * MiB
    reuse = [("alloc", 0, 32 * MiB, 0), ("free", 0, 32 * MiB, 0), ("alloc", 1, 64 * MiB, 0)]
    assert dm.peak_held(reuse, kept=True, **FIT) == dm.peak_held(reuse, **FIT) == 64 * MiB


def test_best_fit_takes_the_smallest_range_that_fits():
    m = dm.DriverModel(fit="best", ties="high")
    for seg, mib in enumerate((8, 2, 4, 2)):
        m.alloc(seg, mib * MiB)
    m.free(0)                  # 8 MiB range at 0
    m.free(2)                  # 4 MiB range at 10 MiB
    assert m.alloc(4, 4 * MiB) == 10 * MiB


@pytest.mark.parametrize("label", dm.FITTING)
def test_the_fitting_models_match_the_h200_on_both_traces(label):
    fig = dm.figures(dm.CANDIDATES[label])
    for key, (device, pool) in dm.MEASURED.items():
        assert fig[key][0] == pytest.approx(device, abs=0.0005), key
        assert fig[key][1] == pytest.approx(pool, abs=0.0005), key


def test_the_upstream_sequence_frees_only_live_segments():
    seq, info = dm.sequence("vision_train", None)
    live = set()
    for op, seg, nbytes, stream in seq:
        if op == "alloc":
            live.add(seg)
        else:
            live.remove(seg)
    assert info["num_device_alloc"] == sum(op == "alloc" for op, *_ in seq) == 210


def whole_units_past_the_small_start(seq):
    """Note [Segment rounding]: once what the pool reserves passes three chunks, it is
    whole chunks again after every segment allocation."""
    held = 0
    for op, _, nbytes, _ in seq:
        held += nbytes if op == "alloc" else -nbytes
        if op == "alloc" and held > 3 * dm.CHUNK and held % dm.CHUNK:
            return False
    return True


@pytest.mark.parametrize("name", dm.TRACES)
def test_segments_of_whole_chunks_hold_on_the_device_what_the_pool_reserves(name):
    # Note [Segment rounding]: past the small start, with small segments of one chunk too
    # and the first rounded segment taking the total back to whole chunks, every segment
    # starts on a chunk boundary, whatever the driver's placement, and the device holds the
    # pool's own peak (with 2 MiB small segments, 1.059 / 1.089 against 1.047 / 1.042).
    seq, info = dm.sequence(name, "32MiB")
    assert whole_units_past_the_small_start(seq)
    for label in dm.FITTING + ("first fit, unmap",):
        assert dm.peak_held(seq, **dm.CANDIDATES[label]) == info["peak_reserved"], label


def test_a_small_pool_holds_on_the_device_what_plain_segments_hold():
    # The corpus's rl_ppo (a few tens of MiB live, docs/decisions.md): with every segment
    # whole units, a part-used unit for each kind of request held several times what it
    # uses; its segments are now the plain ones, packed into the chunks side by side.
    path = os.path.join(os.path.dirname(dm.HERE), "mempool", "traces", "corpus",
                        "rl_ppo.jsonl.gz")
    rounded, info = dm.sequence(path, "32MiB")
    plain, _ = dm.sequence(path, None)
    assert rounded == plain
    held = dm.peak_held(rounded, **FIT)
    assert held == -(-info["peak_reserved"] // dm.CHUNK) * dm.CHUNK   # its chunks, packed
    assert held < 1.5 * info["peak_live"]


def test_the_kept_sequences_are_the_pool_the_h200_measured():
    # The six figures are of the pool at c479c4a: its own peaks there, as MEASURED records.
    for (name, rounding), (_, pool) in dm.MEASURED.items():
        _, info = dm.measured_sequence(name, rounding)
        assert info["peak_reserved"] / info["peak_live"] == pytest.approx(pool, abs=0.0005)


def test_predictions_take_any_trace_file():
    # A workload's own trace (e.g. bench/torch_workloads.py --snapshot) in place of the
    # shipped ones: one row per rounding, the pool's figure first.
    small = os.path.join(os.path.dirname(dm.HERE), "mempool", "traces", "small.jsonl")
    table = dm.predictions_table(settings=(None, "32MiB"), traces=(small,))
    rows = [line for line in table.splitlines() if line.startswith("| plain") or
            line.startswith("| 32MiB")]
    assert len(rows) == 2 and "small: pool" in table
    seq, info = dm.sequence(small, "32MiB")
    assert whole_units_past_the_small_start(seq)
    assert max(n for _, _, n, _ in seq) < dm.CHUNK        # a small pool: plain segments


def _corpus(tmp_path, files):
    import json
    small = os.path.join(os.path.dirname(dm.HERE), "mempool", "traces", "small.jsonl")
    traces = []
    for name, half in files:
        if name != "absent":
            (tmp_path / f"{name}.jsonl").write_bytes(open(small, "rb").read())
        traces.append({"name": name, "half": half, "file": f"{name}.jsonl"})
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": "mempool-corpus", "version": 1, "traces": traces}))
    return str(tmp_path)


def test_the_corpus_table_puts_each_half_side_by_side(tmp_path):
    corpus = _corpus(tmp_path, [("a", "held-out"), ("b", "tuning"), ("absent", "tuning")])
    fig = dm.corpus_figures(corpus)
    assert [(r["name"], r["half"]) for r in fig["rows"]] == [("a", "held-out"), ("b", "tuning")]
    pool, device, allocs = fig["rows"][1]["cells"]["32MiB"]
    assert fig["rows"][1]["cells"]["plain"] == (pool, device, allocs)   # a small pool
    assert device >= pool > 1 and allocs > 0
    assert fig["summary"]["tuning"]["32MiB"] == pytest.approx((device, device))
    table = dm.corpus_table(corpus).splitlines()
    assert table[2].startswith("| tuning | b |") and table[3].startswith("| held-out | a |")
    assert "| tuning | device: geomean, worst |" in table[4]
    (tmp_path / "only").mkdir()
    only_tuning = _corpus(tmp_path / "only", [("b", "tuning")])
    assert dm.corpus_figures(only_tuning)["summary"]["held-out"]["plain"] is None
    assert "| held-out | device: geomean, worst | - | - |" in dm.corpus_table(only_tuning)
