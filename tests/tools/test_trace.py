"""Trace files and importers: format round trips, damaged files, torch snapshots, RMM logs.

Traces are plain data: only the last test, which replays an imported snapshot, needs the
compiled core.
"""
import gzip
import os
import pickle

import pytest

from mempool.tools import trace as mt
from mempool.tools.trace import Event
from _trace_data import RMM_LOG, torch_snapshot, trace_entry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(REPO, "mempool", "traces")

EVENTS = [
    Event("alloc", 1, 4096, 0, 0),
    Event("alloc", 2, 3 << 20, 0, 1500),
    Event("free", 1, 4096, 0, 2000),
    Event("alloc", 3, 600 << 20, 7, 2500),
    Event("free", 2, 3 << 20, 0, 9000),
    Event("free", 3, 600 << 20, 7, 9100),
]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_save_load_round_trip(tmp_path, name):
    path = tmp_path / name
    assert mt.save(EVENTS, path, meta={"source": "test", "note": "ünïcode"}) == len(EVENTS)
    loaded = mt.load(path)
    assert list(loaded) == EVENTS
    assert all(isinstance(ev, Event) for ev in loaded)
    assert loaded.meta == {"source": "test", "note": "ünïcode"}


def test_file_layout_is_a_header_then_one_compact_array_per_line(tmp_path):
    path = tmp_path / "t.jsonl"
    mt.save(EVENTS, path)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(EVENTS)
    assert lines[0].startswith('{"format":"mempool-trace","version":1,"events":6')
    assert lines[1] == '["alloc",1,4096,0,0]'
    assert lines[3] == '["free",1,4096,0,2000]'


def test_gzip_output_is_reproducible(tmp_path):
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    mt.save(EVENTS, a)
    mt.save(EVENTS, b)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes()[:2] == b"\x1f\x8b"


def test_trace_meta_is_kept_by_save(tmp_path):
    tr = mt.Trace(EVENTS, {"source": "x", "seed": 3})
    mt.save(tr, tmp_path / "t.jsonl")
    assert mt.load(tmp_path / "t.jsonl").meta == {"source": "x", "seed": 3}


def test_save_refuses_bad_events_and_writes_nothing(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match=r"event 1: action must be 'alloc', 'free', "
                                         r"'empty_cache' or 'trim'"):
        mt.save([EVENTS[0], ("malloc", 1, 10, 0, 0)], path)
    with pytest.raises(ValueError, match=r"event 0: nbytes must be an int >= 0"):
        mt.save([("alloc", 1, -5, 0, 0)], path)
    with pytest.raises(ValueError, match=r"an alloc needs nbytes > 0"):
        mt.save([("alloc", 1, 0, 0, 0)], path)
    with pytest.raises(ValueError, match=r"meta may not set \['events'\]"):
        mt.save(EVENTS, path, meta={"events": 3})
    assert not path.exists()


# -- damaged files name the file and the line --------------------------------------------


def _write(tmp_path, text, name="bad.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _good_text():
    import json
    head = json.dumps({"format": "mempool-trace", "version": 1, "events": 3})
    return "\n".join([head, '["alloc",1,512,0,0]', '["alloc",2,1024,0,5]',
                      '["free",1,512,0,9]']) + "\n"


def test_bad_json_line_is_named(tmp_path):
    text = _good_text().replace('["alloc",2,1024,0,5]', '["alloc",2,1024,0,5')
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=rf"{path}: line 3: not a valid JSON event"):
        mt.load(path)


def test_bad_field_is_named_with_its_line(tmp_path):
    path = _write(tmp_path, _good_text().replace('["free",1,512,0,9]', '["free",1,512,"s",9]'))
    with pytest.raises(ValueError, match=rf"{path}: line 4: stream must be an int >= 0"):
        mt.load(path)
    path = _write(tmp_path, _good_text().replace('["alloc",1,512,0,0]', '["alloc",1,512,0]'))
    with pytest.raises(ValueError, match=r"line 2: an event must be \[action, id, nbytes"):
        mt.load(path)


def test_truncated_file_is_detected_by_the_declared_count(tmp_path):
    lines = _good_text().splitlines()
    path = _write(tmp_path, "\n".join(lines[:3]) + "\n")
    with pytest.raises(ValueError, match=rf"{path}: line 4: the file ends after 2 of the 3 "
                                         r"events its header declares \(truncated\?\)"):
        mt.load(path)


def test_line_cut_mid_event_is_reported_as_truncated(tmp_path):
    text = _good_text()
    path = _write(tmp_path, text[:-6])
    with pytest.raises(ValueError, match=r"line 4: not a valid JSON event \(the file looks "
                                         r"truncated\)"):
        mt.load(path)


def test_truncated_gzip_names_the_line_where_it_breaks(tmp_path):
    path = tmp_path / "big.jsonl.gz"
    events = [Event("alloc", i, 512 * (i + 1), 0, i) for i in range(20000)]
    mt.save(events, path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=rf"{path}: line \d+: the gzip stream is truncated") as e:
        mt.load(path)
    line = int(str(e.value).split("line ")[1].split(":")[0])
    assert 2 < line < 20001


def test_header_problems_are_line_1(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: empty file"):
        mt.load(_write(tmp_path, ""))
    with pytest.raises(ValueError, match=r"line 1: not a mempool trace"):
        mt.load(_write(tmp_path, '{"format": "other"}\n'))
    with pytest.raises(ValueError, match=r"line 1: trace version 2 is not supported"):
        mt.load(_write(tmp_path, '{"format": "mempool-trace", "version": 2}\n'))
    with pytest.raises(ValueError, match=r"line 1: the header is not valid JSON"):
        mt.load(_write(tmp_path, '{"format": \n'))


def test_more_events_than_declared_is_an_error(tmp_path):
    text = _good_text().replace('"events": 3', '"events": 2')
    with pytest.raises(ValueError, match=r"line 4: the file holds 3 events but its header "
                                         r"declares 2"):
        mt.load(_write(tmp_path, text))


# -- the pool's own history --------------------------------------------------------------


def test_from_pool_history_keeps_allocs_and_free_requests():
    entries = [
        (3, 0x1000, 2 << 20, 0, 10),        # segment_alloc
        (0, 0x1000, 4096, 0, 11),           # alloc
        (1, 0x1000, 4096, 0, 20),           # free_requested
        (2, 0x1000, 4096, 0, 21),           # free_completed
        (5, 0, 1 << 40, 0, 30),             # oom
        (4, 0x1000, 2 << 20, 0, 40),        # segment_free
    ]
    tr = mt.from_pool_history(entries)
    assert list(tr) == [Event("alloc", 0x1000, 4096, 0, 11), Event("free", 0x1000, 4096, 0, 20)]
    assert tr.meta["source"] == "mempool"
    named = [("segment_alloc", 0x1000, 2 << 20, 0, 10), ("alloc", 0x1000, 4096, 0, 11),
             ("free_requested", 0x1000, 4096, 0, 20), ("free_completed", 0x1000, 4096, 0, 21)]
    assert list(mt.from_pool_history(named)) == list(tr)
    with pytest.raises(ValueError, match=r"entry 0 must be \(action, ptr, nbytes, stream"):
        mt.from_pool_history([(0, 1, 2)])


# -- torch snapshots ---------------------------------------------------------------------

def test_fixture_is_in_the_format_torch_reads():
    viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = torch_snapshot()
    text = viz.trace(snap)
    assert "10 entries" in text and "raise OutOfMemoryError" in text
    summary = viz.segsum(snap)
    assert "segments: 2" in summary and "total_reserved: 22.0MiB" in summary


def test_from_torch_snapshot_events():
    snap = torch_snapshot()
    base = 0x7F0000000000
    tr = mt.from_torch_snapshot(snap)
    assert list(tr) == [
        Event("alloc", 0xA000, 1024, 0, 0),               # synthesized: freed, never allocated
        Event("alloc", 0x7E0000000000, 100, 0, 0),        # synthesized: live in the segments
        Event("free", 0xA000, 1024, 0, 0),
        Event("alloc", base, 3_000_000, 0, 5000),
        Event("alloc", base + (3 << 20), 1_000_000, 0, 7000),
        Event("free", base, 3_000_000, 0, 10000),
        Event("alloc", base, 2_000_000, 0, 20000),
    ]
    assert tr.meta["source_ooms"] == 1
    assert tr.meta["synthesized_allocs"] == 2
    assert tr.meta["pytorch_cuda_alloc_conf"] == "expandable_segments:False"


def test_from_torch_snapshot_without_completion_keeps_only_recorded_events():
    tr = mt.from_torch_snapshot(torch_snapshot(), complete=False)
    assert [ev.action for ev in tr] == ["free", "alloc", "alloc", "free", "alloc"]
    assert tr.meta["synthesized_allocs"] == 0


def test_from_torch_snapshot_reads_pickles_and_refuses_code(tmp_path):
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump(torch_snapshot(), f)
    assert list(mt.from_torch_snapshot(path)) == list(mt.from_torch_snapshot(torch_snapshot()))
    assert list(mt.load_any(path)) == list(mt.from_torch_snapshot(path))
    gz = tmp_path / "snap.pickle.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert len(mt.from_torch_snapshot(gz)) == 7

    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "x": os.getcwd}))
    with pytest.raises(ValueError, match=r"not a readable torch memory snapshot.*posix.getcwd"):
        mt.from_torch_snapshot(evil)
    # pickle's persistent-id refusal runs over two lines: the message is still one.
    persistent = tmp_path / "persistent.pickle"
    persistent.write_bytes(b"\x80\x02X\x01\x00\x00\x00aQ.")   # BINPERSID of "a"
    with pytest.raises(ValueError, match="persistent") as refused:
        mt.from_torch_snapshot(persistent)
    assert "\n" not in str(refused.value)


def test_from_torch_snapshot_needs_a_device_when_several_have_traces():
    snap = torch_snapshot()
    snap["device_traces"][1] = [trace_entry("alloc", 0x10, 512, 0, 1)]
    with pytest.raises(ValueError, match=r"several devices \(device 0: 10 entries, device 1: "
                                         r"1 entries\); pass device="):
        mt.from_torch_snapshot(snap)
    tr = mt.from_torch_snapshot(snap, device=1)
    assert list(tr) == [Event("alloc", 0x10, 512, 0, 0)]
    with pytest.raises(ValueError, match=r"device must be an int in \[0, 2\)"):
        mt.from_torch_snapshot(snap, device=5)


def test_from_torch_snapshot_errors():
    with pytest.raises(ValueError, match=r"no 'device_traces' list"):
        mt.from_torch_snapshot({"segments": []})
    bad = torch_snapshot()
    del bad["device_traces"][0][3]["addr"]
    with pytest.raises(ValueError, match=r"device_traces\[0\]\[3\]: a trace entry needs"):
        mt.from_torch_snapshot(bad)
    # Values of the wrong kind are named the same way, never an OverflowError or a TypeError.
    for key, value in (("time_us", "soon"), ("time_us", float("inf")), ("size", float("nan")),
                       ("addr", [1])):
        bad = torch_snapshot()
        bad["device_traces"][0][3][key] = value
        with pytest.raises(ValueError, match=r"device_traces\[0\]\[3\]: a trace entry needs"):
            mt.from_torch_snapshot(bad)
    with pytest.raises(ValueError, match=r"device_traces\[0\] must be a list of trace entries"):
        mt.from_torch_snapshot({"segments": [], "device_traces": [{"a": 1}]})
    bad = torch_snapshot()
    bad["segments"] = [{"stream": 0, "blocks": [{"state": "active_allocated",
                                                  "address": float("inf"), "size": 512}]}]
    with pytest.raises(ValueError, match=r"segments\[0\]: a segment is a dict"):
        mt.from_torch_snapshot(bad)


# -- RMM logs ----------------------------------------------------------------------------

def test_from_rmm_csv(tmp_path):
    path = tmp_path / "rmm_log.csv"
    path.write_text(RMM_LOG)
    tr = mt.from_rmm_csv(path)
    assert list(tr) == [
        Event("alloc", 0x7F8A40000000, 1024, 0, 0),
        Event("alloc", 0x7F8A40000400, 2048, 0x7F8A38001020, 500_000),
        Event("free", 0x7F8A40000000, 1024, 0, 1_250_000),             # past midnight
        Event("free", 0x7F8A40000400, 2048, 0x7F8A38001020, 3_000_000),
    ]
    assert tr.meta == {"source": "rmm-csv", "source_ooms": 1}
    assert list(mt.load_any(path)) == list(tr)


def test_from_rmm_csv_errors_name_the_line(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("Thread,Time,Action,Size\n1,00:00:00.000001,allocate,5\n")
    with pytest.raises(ValueError, match=rf"{p}: line 1: not an RMM log: columns \['Pointer', "
                                         r"'Stream'\] are missing"):
        mt.from_rmm_csv(p)
    p.write_text(RMM_LOG.replace("free,0x7f8a40000000,1024", "free,0x7f8a40000000,12x4"))
    with pytest.raises(ValueError, match=r"line 4: a value does not parse"):
        mt.from_rmm_csv(p)
    p.write_text(RMM_LOG.replace("allocate failure", "reallocate"))
    with pytest.raises(ValueError, match=r"line 5: unknown action 'reallocate'"):
        mt.from_rmm_csv(p)
    p.write_text(RMM_LOG + "140573312345856,00:00:00.003000,allocate\n")
    with pytest.raises(ValueError, match=r"line 7: expected 6 columns, got 3 \(the file looks "
                                         r"truncated\)"):
        mt.from_rmm_csv(p)


def test_load_any_refuses_unknown_content(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hello\n")
    with pytest.raises(ValueError, match=r"line 1: not a recognised trace"):
        mt.load_any(p)


# -- the shipped traces ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["transformer_train.jsonl.gz", "vision_train.jsonl.gz",
                                  "small.jsonl"])
def test_shipped_traces_load_and_are_balanced(name):
    tr = mt.load(os.path.join(TRACES, name))
    live = {}
    peak = cur = 0
    for ev in tr:
        if ev.action == "alloc":
            assert ev.id not in live
            live[ev.id] = ev.nbytes
            cur += ev.nbytes
            peak = max(peak, cur)
        else:
            cur -= live.pop(ev.id)
    assert not live and cur == 0                  # every buffer freed by the end
    assert tr.meta["source"] == "bench/make_traces.py"
    if name.startswith("transformer"):
        # Comparable to the loop the anchors measured: ~22k events, ~7.5 GiB at peak.
        assert 20_000 <= len(tr) <= 24_000
        assert 7.0 <= peak / 2**30 <= 8.0


def test_shipped_traces_are_small():
    total = sum(os.path.getsize(os.path.join(TRACES, f)) for f in os.listdir(TRACES))
    assert total < 2 << 20


# -- a snapshot captured on a GPU --------------------------------------------------------

# Recorded by bench/fragmentation_gpu.py --snapshot on an H200 with PyTorch 2.11 (a 4-layer
# MLP, 4 Adam steps, history without stack frames). PyTorch's own memory_stats() gave a
# reserved peak of 92,274,688 bytes in that run.
H200_SNAPSHOT = os.path.join(REPO, "tests", "data", "torch_snapshot_h200.pickle")
H200_TORCH_RESERVED_PEAK = 92_274_688


def test_import_of_a_snapshot_captured_on_a_gpu():
    tr = mt.from_torch_snapshot(H200_SNAPSHOT)
    # 145 allocs and 124 free requests recorded; the model's 8 parameters were allocated
    # before recording began and are synthesized at the start.
    assert len(tr) == 145 + 124 + 8
    assert tr.meta["synthesized_allocs"] == 8
    assert tr.meta["source_ooms"] == 0
    assert [ev.action for ev in tr[:8]] == ["alloc"] * 8
    assert all(ev.time_ns == 0 for ev in tr[:8])
    assert all(a.time_ns <= b.time_ns for a, b in zip(tr[8:], tr[9:]))
    assert list(mt.load_any(H200_SNAPSHOT)) == list(tr)


def test_replay_of_the_gpu_snapshot_reserves_what_pytorch_reserved():
    from mempool.tools import replay as rp

    r = rp.replay(mt.from_torch_snapshot(H200_SNAPSHOT))
    assert r.unknown_frees == 0 and r.num_ooms == 0
    # The simulated pool under default settings, replaying PyTorch's own trace, reserves no
    # more than PyTorch's allocator did on the GPU.
    assert r.peak_live_bytes < r.peak_reserved_bytes <= H200_TORCH_RESERVED_PEAK
