"""BENCHMARKS.md is what bench/render_benchmarks.py makes of bench/results/<card>.json, so no
figure in it can drift from the machine-readable results; and bench/collect_results.py turns
a GPU run's outputs into that same schema."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import collect_results  # noqa: E402
import render_benchmarks  # noqa: E402


def test_benchmarks_md_is_what_the_renderer_makes_of_the_results():
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        current = f.read()
    assert current == render_benchmarks.render(), (
        "BENCHMARKS.md differs from bench/results/*.json: run python bench/render_benchmarks.py")
    assert current.count("\n") <= 200


def test_check_mode_fails_on_a_drifted_figure(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    assert render_benchmarks.main(["--out", str(out)]) == 0
    assert render_benchmarks.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("| mempool |", "| mempool | 1 |", 1))
    assert render_benchmarks.main(["--check", "--out", str(out)]) == 1


def test_every_figure_has_the_schemas_fields():
    folder = os.path.join(ROOT, "bench", "results")
    present = [card for card in render_benchmarks.CARDS
               if os.path.exists(os.path.join(folder, f"{card}.json"))]
    assert present, f"no card's results in {folder}"
    for card in present:
        data = render_benchmarks.load(card)
        assert data["figures"], card
        for fig in data["figures"]:
            assert fig["n_processes"] >= 1
            assert fig["worst"] is None or fig["n_processes"] > 1, fig


def test_a_figure_without_a_field_is_named(tmp_path):
    (tmp_path / "h200.json").write_text(json.dumps(
        {"card": "x", "figures": [{"table": "t", "row": "r", "column": "c"}]}))
    with pytest.raises(ValueError, match=r"figures\[0\] lacks unit"):
        render_benchmarks.render(str(tmp_path))


def test_a_gpu_runs_outputs_become_a_card_file(tmp_path):
    (tmp_path / "versions.txt").write_text(
        "date: 2030-01-02T03:04:05Z\ncommit: 0123456789abcdef\n"
        "NVIDIA H100 80GB HBM3, 580.1, 81559 MiB\nPython 3.12.3\n")
    (tmp_path / "junit-gpu-1.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    procs = [{"512": {"ns_per_pair": v}} for v in (100.0, 120.0, 110.0)]
    (tmp_path / "allocator_pairs.json").write_text(json.dumps(
        {"caching": procs, "mempool": [{"512": {"ns_per_pair": 30.0}}]}))
    assert collect_results.main([str(tmp_path)]) == 0
    data = json.loads((tmp_path / "h100.json").read_text())
    assert data["card"] == "NVIDIA H100 80GB HBM3"
    figs = {(f["table"], f["row"], f["column"]): f for f in data["figures"]}
    tier = {c: figs[("GPU tier", "tests/gpu", c)]["median"] for c in ("passed", "failed", "skipped")}
    assert tier == {"passed": 3, "failed": 1, "skipped": 1}
    caching = next(f for k, f in figs.items() if k[1] == "PyTorch's caching allocator")
    assert (caching["median"], caching["worst"], caching["n_processes"]) == (110.0, 120.0, 3)
    assert (caching["date"], caching["commit"]) == ("2030-01-02", "0123456")
    # The file renders as a card of BENCHMARKS.md.
    assert "### GPU tier" in render_benchmarks.render(str(tmp_path))


def test_before_after_and_corpus_outputs_merge_into_a_card_file(tmp_path):
    (tmp_path / "versions.txt").write_text(
        "date: 2030-01-02T03:04:05Z\ncommit: 0123456789abcdef\n"
        "NVIDIA H100 80GB HBM3, 580.1, 81559 MiB\n")
    (tmp_path / "before_after.json").write_text(json.dumps({
        "before_commit": "abcdef0",
        "raw": {"pair": {"before": {"512": [90.0, 80.0, 85.0]}, "after": {"512": [70.0, 75.0]}}}}))
    (tmp_path / "corpus.json").write_text(json.dumps({"rows": [
        {"name": "gnn_train", "half": "held-out",
         "cells": {"mempool": {"ratio": 1.04567, "ns_per_event": 500.0},
                   "PyTorch default": {"ratio": 1.2, "ns_per_event": 900.0}}}]}))
    card = tmp_path / "card.json"
    old_table = {"table": "Numba's own cudadrv tests", "row": "under mempool", "column": "passed",
                 "unit": "tests", "median": 162, "worst": None, "n_processes": 1,
                 "date": "2029-01-01", "commit": "1111111", "command": "x"}
    stale = dict(old_table, table="Trace corpus on the device: peak reserved / peak live",
                 row="gone (tuning)", column="mempool")
    card.write_text(json.dumps({"card": "NVIDIA H100 80GB HBM3", "environment": "",
                                "figures": [old_table, stale]}))
    assert collect_results.main([str(tmp_path), "--into", str(card)]) == 0
    figs = {(f["table"], f["row"], f["column"]): f for f in json.loads(card.read_text())["figures"]}
    after = figs[("Allocate + free from Python (cuda pool), this build and the one before",
                  "this build", "512 B")]
    assert (after["median"], after["worst"], after["n_processes"]) == (72.5, 75.0, 2)
    assert ("Allocate + free from Python (cuda pool), this build and the one before",
            "before (abcdef0)", "512 B") in figs
    ratio = figs[("Trace corpus on the device: peak reserved / peak live", "gnn_train (held-out)",
                  "PyTorch default")]
    assert ratio["median"] == 1.2
    # A table this run measured is replaced whole; one it did not measure stays as it was.
    assert ("Trace corpus on the device: peak reserved / peak live", "gone (tuning)",
            "mempool") not in figs
    assert figs[("Numba's own cudadrv tests", "under mempool", "passed")]["date"] == "2029-01-01"
    # One process's replay times are not published.
    assert not any(k[0] == "Trace corpus on the device: ns per event" for k in figs)


def test_corpus_times_of_several_processes_are_their_median_and_worst(tmp_path):
    (tmp_path / "versions.txt").write_text(
        "date: 2030-01-02T03:04:05Z\ncommit: 0123456789abcdef\n"
        "NVIDIA H100 80GB HBM3, 580.1, 81559 MiB\n")
    cell = {"ratio": 1.02, "ns_per_event": 520.0, "ns_per_event_worst": 700.0,
            "ns_per_event_each": [500.0, 700.0, 520.0, 510.0, 530.0, 540.0], "n_processes": 6}
    (tmp_path / "corpus.json").write_text(json.dumps({"processes": 6, "rows": [
        {"name": "moe_train", "half": "held-out", "cells": {"expandable": cell}}]}))
    card = tmp_path / "card.json"
    assert collect_results.main([str(tmp_path), "--into", str(card)]) == 0
    figs = {(f["table"], f["row"], f["column"]): f for f in json.loads(card.read_text())["figures"]}
    t = figs[("Trace corpus on the device: ns per event", "moe_train (held-out)", "expandable")]
    assert (t["median"], t["worst"], t["n_processes"]) == (525.0, 700.0, 6)
    assert "--processes 6" in t["command"]
    r = figs[("Trace corpus on the device: peak reserved / peak live", "moe_train (held-out)",
              "expandable")]
    assert (r["median"], r["worst"], r["n_processes"]) == (1.02, None, 6)


def test_the_largest_batches_become_one_table_of_models_by_allocator(tmp_path):
    (tmp_path / "versions.txt").write_text(
        "date: 2030-01-02T03:04:05Z\ncommit: 0123456789abcdef\n"
        "NVIDIA H100 80GB HBM3, 580.1, 81559 MiB\n")
    batches = {"batch": 56, "batch-llama": 48, "batch-resnet": 180}
    bonus = {"torch": 0, "torch-expandable": 2, "mempool": 3, "mempool-expandable": 4}
    rows = [{"workload": w, "allocator": a, "largest_batch": n + bonus[a], "cap_gib": 24.0,
             "ms_per_step": None, "values": []}
            for a in ("mempool-expandable", "torch", "mempool", "torch-expandable")
            for w, n in batches.items()]
    rows += [{"workload": "batch-llama", "allocator": "torch-async", "error": "boom"},
             {"workload": "gpt", "allocator": "torch", "ms_per_step": 80.0, "values": [1.0]}]
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "workloads.json").write_text(json.dumps({"rows": rows}))
    assert collect_results.main([str(tmp_path)]) == 0
    data = json.loads((tmp_path / "h100.json").read_text())
    table = "Largest training batch under a fixed cap: 24 GiB"
    figs = [f for f in data["figures"] if f["table"] == table]
    assert len(figs) == 12 and len(data["figures"]) == 12
    cell = {(f["row"], f["column"]): f for f in figs}
    assert cell[("Llama-style decoder, length 512", "mempool expandable_segments")]["median"] == 52
    assert cell[("ResNet-50, 224x224 images", "PyTorch")]["n_processes"] == 1
    assert all(f["unit"] == "largest batch" and f["worst"] is None for f in figs)
    assert figs[0]["command"] == ("python bench/torch_workloads.py OUT --workloads "
                                  "batch,batch-llama,batch-resnet --reps 1")
    assert "bench/batch_workloads.py" in data["notes"][table]
    # Rendered: a row per model, in the workloads' order; a column per allocator, PyTorch's
    # two before mempool's two.
    text = render_benchmarks.render(str(tmp_path))
    lines = text[text.index(f"### {table}"):].splitlines()
    head = lines.index("|  | PyTorch | PyTorch expandable_segments | mempool | "
                       "mempool expandable_segments |")
    assert lines[head + 2:head + 5] == [
        "| GPT-2 style decoder, length 512 | 56 | 58 | 59 | 60 |",
        "| Llama-style decoder, length 512 | 48 | 50 | 51 | 52 |",
        "| ResNet-50, 224x224 images | 180 | 182 | 183 | 184 |"]
    assert lines[head + 6] == data["notes"][table]


def test_a_cap_other_than_the_default_names_its_own_table_and_command(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "workloads.json").write_text(json.dumps({"rows": [
        {"workload": "batch-resnet", "allocator": "mempool", "largest_batch": 90,
         "cap_gib": 12.0}]}))
    card = tmp_path / "card.json"
    kept = {"table": "GPU tier", "row": "tests/gpu", "column": "passed", "unit": "tests",
            "median": 5, "worst": None, "n_processes": 1, "date": "2029-01-01",
            "commit": "1111111", "command": "x"}
    card.write_text(json.dumps({"card": "NVIDIA H100 80GB HBM3", "environment": "",
                                "figures": [kept], "notes": {"GPU tier": "kept"}}))
    assert collect_results.main([str(tmp_path), "--into", str(card)]) == 0
    data = json.loads(card.read_text())
    (fig,) = [f for f in data["figures"] if f["table"] != "GPU tier"]
    assert fig["table"] == "Largest training batch under a fixed cap: 12 GiB"
    assert fig["command"].endswith("--reps 1 --batch-cap-gib 12")
    assert (fig["row"], fig["column"], fig["median"]) == (
        "ResNet-50, 224x224 images", "mempool", 90)
    assert set(data["notes"]) == {"GPU tier", fig["table"]}
