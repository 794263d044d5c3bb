"""Hostile files and arguments: every trace reader answers with one clear ValueError in one
line, and every command line error is one line on stderr with exit status 2.

The files are small: each bound is lowered by the test (MAX_INPUT_BYTES, MAX_LINE_BYTES),
so a gzip bomb that exceeds it inflates to a few MiB, not gigabytes.
"""
import csv
import gzip
import os
import pickle

import pytest

import mempool.cli
from mempool.tools import replay as rp
from mempool.tools import trace as mt

from _trace_data import RMM_LOG, torch_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = os.path.join(ROOT, "mempool", "traces", "small.jsonl")
HEADER = '{"format": "mempool-trace", "version": 1}'
MiB = 1 << 20


def _bomb(path, inflated, header=HEADER):
    """A gzip file whose text is a trace header and then `inflated` bytes of valid events."""
    line = b'["free",1,0,0,0]\n'
    with gzip.open(path, "wb") as f:
        f.write(header.encode() + b"\n")
        chunk = line * (MiB // len(line))
        for _ in range(inflated // MiB + 1):
            f.write(chunk)
    return path


def _one_error(path, match=None):
    """load_any's error for `path`: a ValueError of one line naming the file."""
    with pytest.raises(ValueError) as info:
        mt.load_any(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text and len(text) < 1000, text
    if match:
        assert match in text, text
    return text


def _cli(capsys, *argv):
    """(exit status, stderr) of ``python -m mempool ARGV`` run in this process."""
    rc = mempool.cli.main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def _one_line(rc, err, expected=2):
    assert rc == expected, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


# ---- the readers ------------------------------------------------------------------------------

def test_a_gzip_bomb_stops_at_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "MAX_INPUT_BYTES", 2 * MiB)
    bomb = _bomb(tmp_path / "bomb.jsonl.gz", 4 * MiB)
    assert os.path.getsize(bomb) < 64 << 10            # a few KiB that inflate to 4 MiB
    _one_error(bomb, "MAX_INPUT_BYTES")
    # The same in a snapshot's clothes, and a plain file over the cap.
    snap = tmp_path / "bomb.pickle.gz"
    snap.write_bytes(gzip.compress(pickle.dumps({"device_traces": [[]]}) + b"\0" * (3 * MiB)))
    _one_error(snap, "MAX_INPUT_BYTES")
    plain = tmp_path / "big.jsonl"
    plain.write_text(HEADER + "\n" + '["free",1,0,0,0]\n' * (3 * MiB // 17))
    _one_error(plain, "MAX_INPUT_BYTES")


def test_a_long_line_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.jsonl"
    path.write_text(HEADER + "\n" + '["alloc", 1, 512, 0, 0]' + " " * 5000 + "\n")
    _one_error(path, "MAX_LINE_BYTES")


def test_deep_nesting_is_a_value_error(tmp_path):
    deep = 100_000
    event = tmp_path / "event.jsonl"
    event.write_text('{"format": "mempool-trace", "version": 1, "events": 1}\n'
                     + "[" * deep + "]" * deep + "\n")
    _one_error(event, "line 2")
    header = tmp_path / "header.jsonl"
    header.write_text('{"format": "mempool-trace", "version": 1, "x": ' + "[" * deep
                      + "]" * deep + "}\n")
    _one_error(header, "line 1")
    nested = [[]]
    for _ in range(deep):
        nested = [nested]
    snap = torch_snapshot()
    snap["device_traces"][0].append(nested)
    with pytest.raises(ValueError, match="device_traces|nested"):
        mt.from_torch_snapshot(snap)


def test_step_starts_must_be_indices(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"format": "mempool-trace", "version": 1, "step_starts": [[1]]}\n'
                    '["alloc", 1, 512, 0, 0]\n')
    _one_error(path, "step_starts")
    with pytest.raises(ValueError, match="step_starts"):
        rp.replay(mt.Trace([mt.Event("alloc", 1, 512, 0, 0)], {"step_starts": [[1]]}))


def test_a_huge_csv_field_is_a_value_error(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(RMM_LOG + '1,00:00:01.000000,allocate,0x10,"' + "9" * (200 << 10)
                    + '",0x0\n')
    assert (200 << 10) > csv.field_size_limit()
    _one_error(path, "CSV")


def test_rmm_negative_values_are_refused_at_read(tmp_path):
    for bad in ("-512", "+512", "1_000"):
        path = tmp_path / "neg.csv"
        path.write_text(RMM_LOG + f"1,00:00:01.000000,allocate,0x10,{bad},0x0\n")
        _one_error(path, "does not parse")
    path = tmp_path / "stream.csv"
    path.write_text(RMM_LOG + "1,00:00:01.000000,allocate,0x10,512,-1\n")
    _one_error(path, "does not parse")


def test_damaged_gzip_snapshots(tmp_path):
    data = gzip.compress(pickle.dumps(torch_snapshot()))
    truncated = tmp_path / "cut.pickle.gz"
    truncated.write_bytes(data[:len(data) // 2])
    _one_error(truncated, "truncated or damaged")
    corrupt = tmp_path / "corrupt.pickle.gz"
    corrupt.write_bytes(data[:20] + bytes(b ^ 0x5A for b in data[20:60]) + data[60:])
    _one_error(corrupt)
    trace = tmp_path / "cut.jsonl.gz"
    trace.write_bytes(gzip.compress(open(SMALL, "rb").read())[:3000])
    _one_error(trace, "truncated or damaged")


def test_device_traces_of_the_wrong_type(tmp_path):
    path = tmp_path / "types.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [5, 6], "segments": []}))
    _one_error(path, "device_traces[0] must be a list")
    snap = torch_snapshot()
    snap["device_traces"][0].append([1, 2])          # an entry that is not a dict
    with pytest.raises(ValueError, match=r"device_traces\[0\]"):
        mt.from_torch_snapshot(snap)


def test_a_directory_is_not_a_trace(tmp_path):
    _one_error(tmp_path, "is a directory")


def test_concatenated_gzip_members_read_as_one(tmp_path):
    text = open(SMALL, "rb").read()
    half = text.index(b"\n", len(text) // 2) + 1
    path = tmp_path / "two.jsonl.gz"
    path.write_bytes(gzip.compress(text[:half]) + gzip.compress(text[half:]))
    assert mt.load_any(path) == mt.load(SMALL)


# ---- the command line -------------------------------------------------------------------------

def test_cli_hostile_files_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mt, "MAX_INPUT_BYTES", 2 * MiB)
    bomb = _bomb(tmp_path / "bomb.jsonl.gz", 4 * MiB)
    types = tmp_path / "types.pickle"
    types.write_bytes(pickle.dumps({"device_traces": [5, 6]}))
    for argv in (["replay", str(bomb)], ["tune", str(types)], ["replay", str(tmp_path)],
                 ["plot", str(tmp_path / "missing.jsonl")], ["replay", "--limit", "x"]):
        _one_line(*_cli(capsys, *argv))


def test_cli_no_command_prints_the_help_and_exits_2(capsys):
    rc, err = _cli(capsys)
    assert rc == 2 and "usage: python -m mempool" in err and "--debug" in err


def test_cli_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError):
        mempool.cli.main(["--debug", "replay", missing])
    monkeypatch.setenv("MEMPOOL_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        mempool.cli.main(["replay", missing])
    monkeypatch.setenv("MEMPOOL_TRACEBACK", "0")
    _one_line(*_cli(capsys, "replay", missing))


def test_cli_ctrl_c_exits_130_without_a_traceback(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(rp, "replay", interrupted)
    _one_line(*_cli(capsys, "replay", SMALL), expected=130)


def test_cli_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        mempool.cli.main(["replay", "--backend", "nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--backend" in err, err


def test_cli_no_gpu_is_one_line(capsys):
    from mempool import _cuda
    if _cuda.available():
        pytest.skip("a CUDA device is here")
    for argv in (["demo", "--backend", "cuda"], ["replay", SMALL, "--backend", "cuda"],
                 ["replay", SMALL, "--compare", "--backend", "cuda"]):
        rc, err = _cli(capsys, *argv)
        _one_line(rc, err)
        assert "backend='cuda' needs" in err
