"""``replay --corpus --processes N``: each cell in N processes of its own, pinned, the
columns' processes in rounds (mempool/tools/corpus_processes.py), on sim."""
import json
import os

import pytest

from mempool.cli import trace as cli_trace
from mempool.tools import corpus
from mempool.tools import corpus_processes as cp

from _trace_data import make_corpus

# One trace per half: each cell's processes start a Python of their own.
SMALL = (("a", "tuning"), ("c", "held-out"))
CAN_PIN = hasattr(os, "sched_setaffinity")


def test_rounds_run_every_column_before_the_next_round():
    assert cp.schedule(["x", "y", "z"], 2) == [(0, "x"), (0, "y"), (0, "z"),
                                               (1, "x"), (1, "y"), (1, "z")]
    assert cp.schedule(["x"], 3) == [(0, "x"), (1, "x"), (2, "x")]
    assert cp.schedule([], 4) == [] and cp.schedule(["x", "y"], 0) == []


def test_run_rounds_pins_each_round_and_reports_median_and_worst():
    calls, cpus = [], iter([3, 5, 7])

    def runner(label, times):
        def run(cpu):
            calls.append((label, cpu))
            t = times[sum(c[0] == label for c in calls) - 1]
            return {"ratio": 1.5, "peak_reserved_bytes": 10, "num_ooms": 0,
                    "ns_per_event": t, "pinned": True, "cpu": cpu}
        return run

    cells, note = cp.run_rounds({"x": runner("x", [30, 10, 20]),
                                 "y": runner("y", [5, 50, 6])}, 3,
                                pick=lambda: (next(cpus), None))
    assert calls == [("x", 3), ("y", 3), ("x", 5), ("y", 5), ("x", 7), ("y", 7)]
    assert note is None
    x, y = cells["x"], cells["y"]
    assert (x["ns_per_event"], x["ns_per_event_worst"], x["n_processes"]) == (20, 30, 3)
    assert (y["ns_per_event"], y["ns_per_event_worst"]) == (6, 50)
    assert x["ns_per_event_each"] == [30, 10, 20] and x["children_agree"] and x["pinned"]
    assert "cpu" not in x and x["peak_reserved_bytes"] == 10


def test_a_failing_process_is_its_cells_error_and_disagreement_is_recorded():
    calls = []

    def failing(cpu):
        calls.append(cpu)
        return {"error": "RuntimeError: no device"}

    peaks = iter([10, 12])

    def drifting(cpu):
        return {"ratio": 1.0, "peak_reserved_bytes": next(peaks), "num_ooms": 0,
                "ns_per_event": 1.0}

    cells, note = cp.run_rounds({"bad": failing, "odd": drifting}, 2,
                                pick=lambda: (None, "not pinned: no way here"))
    assert cells["bad"] == {"error": "RuntimeError: no device"} and len(calls) == 1
    odd = cells["odd"]
    assert not odd["children_agree"] and odd["peak_reserved_bytes_each"] == [10, 12]
    assert odd["peak_reserved_bytes"] == 10 and not odd["pinned"]
    assert note == "not pinned: no way here"


def test_cells_in_processes_keep_the_one_process_figures(tmp_path, capsys):
    make_corpus(tmp_path, absent=(), traces=SMALL)
    args = ["replay", "--corpus", str(tmp_path), "--json"]
    assert cli_trace.main(args[0], args[1:]) == 0
    one = json.loads(capsys.readouterr().out)
    assert "processes" not in one and "n_processes" not in one["rows"][0]["cells"]["mempool"]
    assert cli_trace.main(args[0], args[1:] + ["--processes", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["processes"] == 2 and two["pinned"] is CAN_PIN
    for r1, r2 in zip(one["rows"], two["rows"]):
        assert r1["name"] == r2["name"] and r1["events"] == r2["events"]
        for label in corpus.DEFAULT_MODES:
            c1, c2 = r1["cells"][label[0]], r2["cells"][label[0]]
            for key in ("ratio", "peak_reserved_bytes", "num_ooms"):
                assert c1[key] == c2[key], (r1["name"], label, key)
            assert c2["n_processes"] == 2 and len(c2["ns_per_event_each"]) == 2
            assert 0 < c2["ns_per_event"] <= c2["ns_per_event_worst"]
            assert c2["ns_per_event_worst"] == max(c2["ns_per_event_each"])
            assert c2["children_agree"] and c2["pinned"] is CAN_PIN
    for half in corpus.HALVES:
        s = two["summary"][half]["mempool expandable"]
        assert s["ns_per_event"] <= s["ns_per_event_worst"]
    # The table: the worst beside the median, every line of the rows as wide as its heading.
    text = corpus.format_report(two)
    lines = text.splitlines()
    assert "each cell in 2 processes" in lines[0] and "worst process" in lines[1]
    heading = lines[3]
    assert heading.endswith("res/live  OOMs  ns/ev  worst")
    rows = [ln for ln in lines[4:] if ln.startswith(("tuning ", "held-out "))]
    assert len(rows) == 2 and all(len(ln) == len(heading) for ln in rows)
    assert len(lines[2].rstrip()) <= len(heading)


def test_outside_columns_are_called_once_per_process_with_its_cpu(tmp_path):
    seen = []

    def fake(path, cpu=None):
        seen.append((os.path.basename(path), cpu))
        return {"ratio": 1.5, "peak_reserved_bytes": 1, "num_ooms": 0,
                "ns_per_event": 7.0 + len(seen), "pinned": cpu is not None}

    make_corpus(tmp_path, absent=(), traces=SMALL)
    report = corpus.replay_corpus(tmp_path, modes=(), torch_rows=[("PyTorch", fake)],
                                  processes=3)
    assert [name for name, _ in seen] == ["a.jsonl.gz"] * 3 + ["c.jsonl.gz"] * 3
    assert all((cpu is not None) is CAN_PIN for _, cpu in seen)
    cell = report["rows"][0]["cells"]["PyTorch"]
    assert (cell["ns_per_event"], cell["ns_per_event_worst"], cell["n_processes"]) == (
        9.0, 10.0, 3)
    assert report["pinned"] is CAN_PIN and (report["notes"] == []) is CAN_PIN


def test_where_no_process_can_be_pinned_the_report_says_so(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    cpu, note = cp.pick_cpu()
    assert cpu is None and "no os.sched_setaffinity" in note
    make_corpus(tmp_path, absent=(), traces=SMALL[:1])
    report = corpus.replay_corpus(
        tmp_path, modes=(), processes=2,
        torch_rows=[("t", lambda path, cpu=None: {"ratio": 1.0, "peak_reserved_bytes": 1,
                                                  "num_ooms": 0, "ns_per_event": 1.0})])
    assert report["pinned"] is False
    assert [n for n in report["notes"] if "not pinned" in n]
    assert "(not all pinned)" in corpus.format_report(report).splitlines()[0]


@pytest.mark.skipif(not CAN_PIN, reason="os.sched_setaffinity is Linux's")
def test_a_child_that_cannot_take_its_cpu_says_why():
    assert cp._pin(None) == {}
    got = cp._pin(1 << 20)                     # no such CPU: refused, nothing moves
    assert got["pinned"] is False and got["cpu"] == 1 << 20 and "Error" in got["pin_error"]
    cpu, note = cp.pick_cpu()
    assert note is None and cpu in os.sched_getaffinity(0)


@pytest.mark.parametrize("value, wrong", [("0", "got 0: each cell needs at least one"),
                                          ("-2", "got -2"), ("x", "got 'x'"),
                                          ("2.5", "got '2.5'"), ("65", "got 65")])
def test_a_bad_number_of_processes_is_refused(tmp_path, capsys, value, wrong):
    make_corpus(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli_trace.main("replay", ["--corpus", str(tmp_path), "--processes", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--processes" in err and wrong in err
    assert f"a whole number from 1 to {cp.MAX_PROCESSES}" in err


def test_processes_without_a_corpus_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli_trace.main("replay", ["--processes", "2"])
    assert e.value.code == 2
    assert "give it with --corpus" in capsys.readouterr().err


def test_replay_corpus_refuses_a_bad_count_and_a_driver_pool_of_this_process(tmp_path):
    make_corpus(tmp_path, absent=(), traces=SMALL[:1])
    for bad in (0, True, 2.0, cp.MAX_PROCESSES + 1):
        with pytest.raises(ValueError, match="processes: expected a whole number"):
            corpus.replay_corpus(tmp_path, processes=bad)
    with pytest.raises(ValueError, match="CudaDriverPool"):
        corpus.replay_corpus(tmp_path, processes=2, driver_pool=object())
