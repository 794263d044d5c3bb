"""The trace corpus: its manifest and two halves, ``replay --corpus``, and the recorder's
conversion of recorded runs (bench/corpus), on sim."""
import json
import os
import pickle
import sys

import pytest

import mempool
import mempool.cli
from mempool.cli import trace as cli_trace
from mempool.tools import corpus
from mempool.tools import replay as rp
from mempool.tools import trace as mtrace

from _trace_data import make_corpus, trace_entry, training_trace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench", "corpus"))
import convert  # noqa: E402
import record  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

MiB = 1 << 20


# ------------------------------------------------------------------------------------------
# replay --corpus


def test_replay_corpus_reports_each_half_and_both_modes(tmp_path):
    report = corpus.replay_corpus(make_corpus(tmp_path))
    assert report["columns"] == ["mempool", "mempool expandable"]
    assert [r["name"] for r in report["rows"]] == ["a", "b", "c", "d", "later"]
    later = report["rows"][-1]
    assert "missing" in later and "cells" not in later
    for row in report["rows"][:4]:
        assert row["steps"] == 4 and row["events"] == len(training_trace(0))
        for cell in row["cells"].values():
            assert cell["ratio"] >= 1.0 and cell["num_ooms"] == 0
            assert cell["peak_reserved_bytes"] >= row["peak_live_bytes"]
    s = report["summary"]
    assert s["tuning"]["traces"] == 2 and s["held-out"]["traces"] == 2
    assert s["held-out"]["not_recorded"] == 1
    for half in corpus.HALVES:
        ratios = [r["cells"]["mempool"]["ratio"] for r in report["rows"]
                  if r["half"] == half and "cells" in r]
        assert s[half]["mempool"]["worst_ratio"] == max(ratios)
        assert min(ratios) <= s[half]["mempool"]["geomean_ratio"] <= max(ratios)
    # The expandable column replays with expandable segments: its figures are its own.
    a = corpus.replay_corpus(tmp_path, modes=(("x", {"expandable_segments": True}),))
    direct = rp.replay(str(tmp_path / "a.jsonl.gz"), expandable_segments=True)
    assert a["rows"][0]["cells"]["x"]["peak_reserved_bytes"] == direct.peak_reserved_bytes


def test_outside_columns_are_reported_beside_the_pool(tmp_path):
    seen = []

    def fake(path):
        seen.append(os.path.basename(path))
        return {"ratio": 1.5, "peak_reserved_bytes": 1, "num_ooms": 2, "ns_per_event": 7.0}

    report = corpus.replay_corpus(make_corpus(tmp_path, absent=()),
                                  torch_rows=[("PyTorch default", fake)])
    assert seen == ["a.jsonl.gz", "b.jsonl.gz", "c.jsonl.gz", "d.jsonl.gz"]
    assert report["summary"]["tuning"]["PyTorch default"]["num_ooms"] == 4
    text = corpus.format_report(report)
    assert "PyTorch default" in text and "1.500" in text


def test_cli_corpus_table_and_json(tmp_path, capsys):
    make_corpus(tmp_path)
    assert cli_trace.main("replay", ["--corpus", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("tuning (2 traces)", "held-out (2 traces)", "mempool expandable",
                 "not recorded", "PyTorch's columns need a GPU"):
        assert text in out
    lines = out.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith(("tuning ", "held-out "))] == [
        "a", "b", "c", "d", "later"]
    assert cli_trace.main("replay", ["--corpus", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["backend"] == "sim" and len(d["rows"]) == 5 and d["note"]


def test_cli_corpus_conf_applies_to_both_modes(tmp_path, capsys):
    make_corpus(tmp_path, absent=())
    assert cli_trace.main("replay", ["--corpus", str(tmp_path), "--json", "--conf",
                                     "roundup_power2_divisions:4"]) == 0
    d = json.loads(capsys.readouterr().out)
    plain = rp.replay(str(tmp_path / "a.jsonl.gz"), conf={"roundup_power2_divisions": 4})
    assert d["rows"][0]["cells"]["mempool"]["peak_reserved_bytes"] == plain.peak_reserved_bytes


@pytest.mark.parametrize("args", [["x.jsonl"], ["--compare"], ["--plot", "x.png"]])
def test_cli_corpus_refuses_what_it_does_not_do(tmp_path, capsys, args):
    make_corpus(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli_trace.main("replay", ["--corpus", str(tmp_path)] + args)
    assert e.value.code == 2
    assert "without --corpus" in capsys.readouterr().err


@pytest.mark.parametrize("manifest, message", [
    (None, "holds no manifest.json"),
    ("{nope", "not valid JSON"),
    ({"format": "other", "version": 1, "traces": []}, "not a corpus manifest"),
    ({"format": "mempool-corpus", "version": 9, "traces": []}, "version 9 is not supported"),
    ({"format": "mempool-corpus", "version": 1, "traces": {}}, '"traces" must be a list'),
    ({"format": "mempool-corpus", "version": 1, "traces": [
        {"name": "a", "half": "train", "file": "a.jsonl"}]}, '"half" must be one of'),
    ({"format": "mempool-corpus", "version": 1, "traces": [
        {"name": "a", "half": "tuning", "file": "a"}, {"name": "a", "half": "tuning",
                                                       "file": "b"}]}, "listed twice"),
    ({"format": "mempool-corpus", "version": 1, "traces": [
        {"name": "a", "half": "tuning", "file": "/abs.jsonl"}]}, "relative to the"),
    ({"format": "mempool-corpus", "version": 1, "traces": [{"half": "tuning"}]},
     '"name" must be'),
])
def test_bad_manifest_is_a_clear_error(tmp_path, capsys, manifest, message):
    if manifest is not None:
        (tmp_path / corpus.MANIFEST).write_text(
            manifest if isinstance(manifest, str) else json.dumps(manifest))
    with pytest.raises(ValueError, match=message):
        corpus.load_manifest(tmp_path)
    assert mempool.cli.main(["replay", "--corpus", str(tmp_path)]) == 2
    assert message.split('"')[-1].strip() in capsys.readouterr().err


def test_corpus_that_is_no_folder(tmp_path, capsys):
    assert mempool.cli.main(["replay", "--corpus", str(tmp_path / "none")]) == 2
    assert "is not a folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# the shipped corpus


def test_shipped_manifest_matches_the_workloads_and_its_files():
    entries = corpus.load_manifest()
    by_name = {e["name"]: e for e in entries}
    # The split is defined with the workloads; the manifest is its copy.
    for name, w in WORKLOADS.items():
        assert by_name[name]["half"] == w.half
        assert by_name[name]["args"] == f"--only {name}"
        assert by_name[name]["description"] == w.description
    assert by_name["transformer_train"]["half"] == by_name["vision_train"]["half"] == "tuning"
    assert set(by_name) == set(WORKLOADS) | {"transformer_train", "vision_train"}
    recorded = [e for e in entries if e.recorded]
    assert {"transformer_train", "vision_train"} <= {e["name"] for e in recorded}
    for e in recorded:
        prep = rp.prepare(mtrace.load(e.path))
        assert e["events"] == prep.events
        assert e["peak_live_bytes"] == prep.peak_live_bytes
        assert e["steps"] == len(prep.step_ops or ())


def test_shipped_recordings_are_small_and_marked():
    recorded = [e for e in corpus.load_manifest() if e.recorded and e["name"] in WORKLOADS]
    if not recorded:
        pytest.skip("the corpus's workloads are not recorded yet (bench/corpus/record.py)")
    for e in recorded:
        assert os.path.getsize(e.path) < convert.MAX_BYTES + 4096, e["name"]
        assert e["steps"] >= 2 and e["card"] and e["recorded_with"], e["name"]


# ------------------------------------------------------------------------------------------
# the recorder's conversion (bench/corpus/convert.py, record.py)


def marked_snapshot(steps=3, base=1 << 40):
    """A PyTorch snapshot of a loop that marks each step as record.py's children do."""
    ent, t = [], [0]

    def add(action, addr, size):
        t[0] += 3
        ent.append(trace_entry(action, addr, size, t=t[0]))

    add("alloc", base, 4 * MiB)                              # a parameter
    for s in range(steps):
        add("alloc", base + MiB * 64, convert.MARKS[0])
        add("alloc", base + MiB * 65, convert.MARKS[1])
        add("free_requested", base + MiB * 65, convert.MARKS[1])
        add("free_requested", base + MiB * 64, convert.MARKS[0])
        for k in range(3):
            add("alloc", base + MiB * (8 + k * 8), (s + 1 + k) * MiB)
        for k in range(3):
            add("free_requested", base + MiB * (8 + k * 8), (s + 1 + k) * MiB)
    return {"segments": [], "device_traces": [ent]}


def test_marks_become_step_starts():
    events = mtrace.from_torch_snapshot(marked_snapshot())
    body, starts = convert.take_marks(list(events))
    assert starts == [1, 7, 13] and len(body) == 19
    assert convert.MARKS[0] not in {ev.nbytes for ev in body}
    assert convert.MARKS[1] not in {ev.nbytes for ev in body}


def test_compact_renames_without_changing_the_replay():
    events = mtrace.from_torch_snapshot(marked_snapshot())
    events = [ev._replace(stream=0x7F00 if ev.nbytes == 2 * MiB else 0) for ev in events]
    small = convert.compact(events)
    assert max(ev.id for ev in small) <= len(small) and {ev.stream for ev in small} == {0, 1}
    assert all(ev.time_ns % 1000 == 0 for ev in small) and small[0].time_ns == 0
    a, b = rp.replay(events), rp.replay(small)
    assert (a.peak_reserved_bytes, a.peak_live_bytes, a.num_device_alloc) == (
        b.peak_reserved_bytes, b.peak_live_bytes, b.num_device_alloc)
    assert convert.peak_live(small) == b.peak_live_bytes


def test_cap_cuts_at_a_step_start_and_keeps_one_step():
    events, starts = list(range(100)), [5, 30, 60, 90]
    assert convert.cap(events, starts, 100) == (events, starts)
    assert convert.cap(events, starts, 70) == (events[:60], [5, 30])
    assert convert.cap(events, starts, 10) == (events[:30], [5])
    assert convert.cap(events, [5], 10) == (events, [5])


def test_finish_writes_a_marked_trace_under_the_size(tmp_path):
    events = mtrace.from_torch_snapshot(marked_snapshot(steps=40))
    path = str(tmp_path / "t.jsonl.gz")
    header = convert.finish(events, {"workload": "t"}, path)
    assert header["steps"] == header["steps_recorded"] == 40
    loaded = mtrace.load(path)
    assert loaded.meta["step_starts"] == header["step_starts"] and len(loaded) == header["events"]
    assert len(rp.replay(loaded).steps) == 40
    # Too large: whole steps are left out until it fits.
    small = convert.finish(events, {}, path, max_bytes=os.path.getsize(path) // 2)
    assert 1 <= small["steps"] < 40 and small["steps_recorded"] == 40
    assert os.path.getsize(path) <= os.path.getsize(str(tmp_path / "t.jsonl.gz"))
    assert len(mtrace.load(path)) == small["events"] < header["events"]


def test_recorded_runs_become_traces_and_a_manifest(tmp_path):
    """record.py's parent half: what a torch child and the CuPy child leave becomes
    corpus traces, with their provenance in the manifest."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "bert_finetune.pickle").write_bytes(pickle.dumps(marked_snapshot()))
    pool = mempool.Pool(backend="sim")
    pool.record_history(True)
    for _ in range(2):
        marks = [pool.alloc(n) for n in convert.MARKS]
        for p in marks:
            pool.free(p)
        pool.free(pool.alloc(MiB))
    pool.save_trace(str(work / "cupy_pipeline.history.jsonl.gz"))
    for name in ("bert_finetune", "cupy_pipeline"):
        (work / f"{name}.info.json").write_text(json.dumps({"card": "a card", "marks": 3}))
    errors = {"gnn_train": "exit 1: boom"}
    assert record.convert_all(str(work), str(out), errors) == 0
    entries = {e["name"]: e for e in corpus.load_manifest(out)}
    bert, cupy = entries["bert_finetune"], entries["cupy_pipeline"]
    assert bert["steps"] == 3 and cupy["steps"] == 2 and bert["card"] == "a card"
    assert bert["half"] == "tuning" and cupy["half"] == "held-out"
    assert bert["args"] == "--only bert_finetune" and bert["script"] == record.SCRIPT
    assert entries["gnn_train"]["error"] == "exit 1: boom"
    assert entries["gnn_train"]["recorded"] is False
    assert entries["transformer_train"]["events"] == 21860
    header = mtrace.load(str(out / "bert_finetune.jsonl.gz")).meta
    assert header["source"] == "torch-snapshot" and header["half"] == "tuning"


def test_record_refuses_unknown_workloads(capsys):
    with pytest.raises(SystemExit) as e:
        record.main(["/tmp/nowhere", "--only", "bert_finetune,nope"])
    assert e.value.code == 2
    assert "unknown workloads ['nope']" in capsys.readouterr().err


def test_cli_corpus_leaves_fixed_segment_options_out_of_the_expandable_column(tmp_path,
                                                                               capsys):
    make_corpus(tmp_path, absent=())
    args = ["--corpus", str(tmp_path), "--conf", "segment_rounding:32MiB"]
    assert cli_trace.main("replay", args + ["--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["rows"][0]["cells"]
    path = str(tmp_path / "a.jsonl.gz")
    assert cells["mempool"]["peak_reserved_bytes"] == rp.replay(
        path, conf={"segment_rounding": "32MiB"}).peak_reserved_bytes
    assert cells["mempool expandable"]["peak_reserved_bytes"] == rp.replay(
        path, expandable_segments=True).peak_reserved_bytes
    assert cli_trace.main("replay", args) == 0
    assert "mempool expandable: without segment_rounding" in capsys.readouterr().out
