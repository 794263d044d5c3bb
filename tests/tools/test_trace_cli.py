"""The replay, tune and plot commands on the shipped traces and on imported formats."""
import json
import os
import pickle
import subprocess
import sys

import pytest

import mempool.cli
from mempool.cli import trace as cli_trace

from _trace_data import RMM_LOG, torch_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = os.path.join(REPO, "mempool", "traces", "small.jsonl")


def test_replay_default_trace(capsys):
    assert cli_trace.main("replay", []) == 0
    out = capsys.readouterr().out
    assert "transformer_train.jsonl.gz" in out
    assert "reserved/live" in out and "peak live" in out


def test_replay_json_and_conf(capsys):
    assert cli_trace.main("replay", [SMALL, "--conf", "roundup_power2_divisions:4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["trace"] == SMALL
    assert d["peak_reserved_bytes"] >= d["peak_live_bytes"] > 0
    assert d["num_ooms"] == 0 and d["ratio"] >= 1.0


def test_replay_says_where_the_excess_lay_at_the_peak(capsys):
    assert cli_trace.main("replay", [SMALL]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("at the peak")]
    assert len(line) == 1 and "cached blocks (the largest" in line[0], line
    assert cli_trace.main("replay", [SMALL, "--json"]) == 0
    at = json.loads(capsys.readouterr().out)["at_peak"]
    assert at["reserved_bytes"] == at["live_bytes"] + at["rounding_bytes"] + at["free_bytes"]


def test_replay_under_a_limit_reports_ooms(capsys):
    assert cli_trace.main("replay", [SMALL, "--limit", "20MB"]) == 0
    out = capsys.readouterr().out
    assert "OOMs" in out and "OOMs           0" not in out


def test_replay_imported_formats(tmp_path, capsys):
    snap = tmp_path / "snapshot.pickle"
    snap.write_bytes(pickle.dumps(torch_snapshot()))
    rmm = tmp_path / "log.csv"
    rmm.write_text(RMM_LOG)
    for path in (snap, rmm):
        assert cli_trace.main("replay", [str(path)]) == 0
        assert "reserved/live" in capsys.readouterr().out


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "mempool-trace", "version": 1}\n["alloc",1\n')
    assert mempool.cli.main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 2" in err and len(err.splitlines()) == 1, err
    assert cli_trace.main("nope", []) == 2


def test_tune_small(capsys):
    assert cli_trace.main("tune", [SMALL, "--quiet", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "settings replayed on sim" in out and "MEMPOOL_CONF" in out


def test_tune_default_trace_runs(capsys):
    assert cli_trace.main("tune", ["--quiet", "--top", "3"]) == 0
    assert "transformer_train.jsonl.gz" in capsys.readouterr().out


def test_plot_commands(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    timeline = tmp_path / "timeline.png"
    assert cli_trace.main("plot", [SMALL, "--out", str(timeline)]) == 0
    segments = tmp_path / "segments.png"
    assert cli_trace.main("plot", [SMALL, "--segments", "--out", str(segments)]) == 0
    snap = tmp_path / "snapshot.pickle"
    snap.write_bytes(pickle.dumps(torch_snapshot()))
    snapmap = tmp_path / "snapmap.png"
    assert cli_trace.main("plot", [str(snap), "--out", str(snapmap)]) == 0
    replayed = tmp_path / "replay.png"
    assert cli_trace.main("replay", [SMALL, "--plot", str(replayed)]) == 0
    for p in (timeline, segments, snapmap, replayed):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_dispatch():
    r = subprocess.run([sys.executable, "-m", "mempool", "replay", SMALL], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "reserved/live" in r.stdout


def test_replay_compare_puts_both_modes_side_by_side(capsys):
    """--compare: expandable segments off and on, each row the figures of a replay of its
    own; off a GPU, PyTorch's rows are left out saying why."""
    from mempool.tools import replay as rp

    assert cli_trace.main("replay", [SMALL, "--compare", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["allocator"] for r in d["rows"]] == ["mempool", "mempool expandable_segments"]
    for row, expandable in zip(d["rows"], (False, True)):
        alone = rp.replay(cli_trace._load(SMALL), expandable_segments=expandable)
        assert row["ratio"] == alone.ratio
        assert row["calls_per_step"] == alone.calls_per_step
        assert row["num_device_alloc"] == alone.num_device_alloc
        assert row["driver_reserved_peak_bytes"] is None      # no cudaMemPool on sim
    assert "--backend cuda" in d["note"]

    assert cli_trace.main("replay", [SMALL, "--compare", "--conf", "roundup_power2_divisions:4"]) == 0
    out = capsys.readouterr().out
    assert "mempool expandable_segments" in out and "upstream calls per step" in out
    assert "PyTorch's rows need a GPU" in out


def test_replay_compare_refuses_a_bad_conf_as_replay_does(capsys):
    assert mempool.cli.main(["replay", SMALL, "--compare", "--conf", "bogus:1"]) == 2
    captured = capsys.readouterr()
    assert "unknown option 'bogus'" in captured.err
    assert "mempool expandable_segments" not in captured.out


def test_replay_compare_runs_fixed_segment_options_on_the_default_row_only(capsys):
    """A conf with segment_rounding (which expandable segments refuse) compares instead of
    failing: the default row takes it, the expandable row runs without it and says so."""
    from mempool.tools import replay as rp

    assert cli_trace.main("replay", [SMALL, "--compare", "--json", "--conf",
                                     "segment_rounding:32MiB"]) == 0
    d = json.loads(capsys.readouterr().out)
    rounded = rp.replay(cli_trace._load(SMALL), segment_rounding="32MiB")
    expandable = rp.replay(cli_trace._load(SMALL), expandable_segments=True)
    assert [r["ratio"] for r in d["rows"]] == [rounded.ratio, expandable.ratio]
    assert cli_trace.main("replay", [SMALL, "--compare", "--conf", "segment_rounding:32MiB"]) == 0
    assert "mempool expandable_segments: without segment_rounding" in capsys.readouterr().out


def test_replay_takes_a_conf_dict_naming_a_backend():
    # The backend argument wins, as over a conf string's backend key; it was a TypeError
    # ("multiple values for keyword argument 'backend'").
    from mempool.tools import replay as rp

    events = cli_trace._load(SMALL)
    assert rp.replay(events, conf={"backend": "host"}).backend == "sim"
    assert rp.replay(events, conf={"backend": "host"}).ratio == rp.replay(events).ratio


def test_replay_compare_refuses_plot(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_trace.main("replay", [SMALL, "--compare", "--plot", str(tmp_path / "x.png")])
    assert e.value.code == 2
    assert "--compare draws no plot" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_pytorch_row_that_cannot_run_is_reported_not_raised():
    """The PyTorch rows run in a child process; where PyTorch or a GPU is missing, the row
    carries the child's error."""
    import importlib.util

    row = cli_trace._torch_row(SMALL, "expandable_segments:True")
    has_torch = importlib.util.find_spec("torch") is not None
    if has_torch:
        import torch
        if torch.cuda.is_available():
            assert row["ratio"] >= 1.0 and row["calls_per_step"] is not None
            return
    assert "error" in row and row["error"]
    if not has_torch:
        assert "torch" in row["error"]


def test_the_driver_pools_peak_is_read_only_where_segments_come_from_it():
    """On cuda without expandable segments a replay reports the cudaMemPool's own reserved
    high watermark: it keeps the segments the pool gives back, so it is the device memory
    the process held."""
    from mempool.tools import replay as rp

    stats = {"cuda_pool.reserved_high": 123 << 20}
    assert rp._driver_peak("cuda", {"expandable_segments": False}, stats) == 123 << 20
    assert rp._driver_peak("cuda", {"expandable_segments": True}, stats) is None
    assert rp._driver_peak("sim", {"expandable_segments": False}, stats) is None
    assert rp._driver_peak("cuda", {}, {}) is None
    assert rp.replay(cli_trace._load(SMALL)).driver_reserved_peak_bytes is None
