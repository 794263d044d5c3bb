"""The corpus's driver pool column (mempool/tools/corpus.py): each trace straight on a fresh
cudaMemPool. No GPU here: the column's logic runs on a fake cudaMemPool, the model of
bench/driver_model.py, and on cuda without a device it is left out with a line."""
import json
import os
import sys

import pytest

from mempool.tools import corpus
from mempool.tools import replay as rp
from mempool.tools import trace as mtrace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))
import driver_model as dm  # noqa: E402

MiB = 1 << 20


class FakeDriverPool:
    """CudaDriverPool's methods over the cudaMemPool model: addresses are the model's, and
    `capacity` refuses what would hold more chunks than it."""

    def __init__(self, capacity=None, fail_on=None):
        self.capacity, self.fail_on = capacity, fail_on
        self.calls = []
        self.opened = self.closed = 0

    def open(self, nstreams):
        self.model = dm.DriverModel(**dm.CANDIDATES[dm.FITTING[0]])
        self.nstreams, self.next_seg, self.segs = nstreams, 0, {}
        self.opened += 1

    def alloc(self, nbytes, stream):
        assert 0 <= stream < self.nstreams
        if self.fail_on is not None and nbytes == self.fail_on:
            raise RuntimeError("the driver failed")
        seg, self.next_seg = self.next_seg, self.next_seg + 1
        addr = self.model.alloc(seg, nbytes, stream) + 4096   # never 0
        if self.capacity is not None and self.model.held > self.capacity:
            self.model.free(seg)
            return 0
        self.segs[addr] = seg
        self.calls.append(("alloc", nbytes, stream))
        return addr

    def free(self, ptr, stream):
        self.model.free(self.segs.pop(ptr))
        self.calls.append(("free", ptr, stream))

    def empty(self):
        self.calls.append(("empty",))

    def close(self):
        self.closed += 1
        assert not self.segs, "every allocation freed before the pool is destroyed"
        return self.model.peak


def events(*sizes_mib, empty_after=None, streams=None):
    """Each size allocated then all freed in reverse, an empty_cache after the
    `empty_after`-th allocation, stream k for allocation k from `streams`."""
    ev, t = [], 0
    for i, n in enumerate(sizes_mib):
        s = streams[i] if streams else 0
        ev.append(mtrace.Event("alloc", i + 1, n * MiB, s, t))
        t += 1
        if empty_after == i:
            ev.append(mtrace.Event("empty_cache", 0, 0, 0, t))
            t += 1
    for i in reversed(range(len(sizes_mib))):
        ev.append(mtrace.Event("free", i + 1, sizes_mib[i] * MiB,
                               streams[i] if streams else 0, t))
        t += 1
    return mtrace.Trace(ev, {})


def make_corpus(tmp_path, traces):
    entries = []
    for name, half, trace in traces:
        mtrace.save(trace, tmp_path / f"{name}.jsonl.gz")
        entries.append({"name": name, "half": half, "file": f"{name}.jsonl.gz"})
    (tmp_path / corpus.MANIFEST).write_text(json.dumps(
        {"format": corpus.FORMAT, "version": corpus.VERSION, "traces": entries}))
    return tmp_path


def test_a_trace_replays_straight_on_the_driver_pool():
    prep = rp.prepare(events(20, 20, 2))
    api = FakeDriverPool()
    cell = corpus.replay_on_driver_pool(prep, api)
    # 42 MiB live back to back: the model holds two 32 MiB chunks.
    assert cell["peak_reserved_bytes"] == 64 * MiB
    assert cell["ratio"] == pytest.approx(64 / 42)
    assert cell["num_ooms"] == 0 and cell["ns_per_event"] > 0
    assert [c[0] for c in api.calls] == ["alloc"] * 3 + ["free"] * 3
    assert api.opened == api.closed == 1


def test_frees_go_to_the_trace_streams_and_empty_cache_between_the_ops():
    prep = rp.prepare(events(4, 8, 12, empty_after=0, streams=[0, 1, 1]))
    api = FakeDriverPool()
    corpus.replay_on_driver_pool(prep, api)
    assert api.nstreams == 2
    assert [c[0] for c in api.calls] == ["alloc", "empty", "alloc", "alloc", "free", "free",
                                         "free"]
    assert [c[2] for c in api.calls if c[0] != "empty"] == [0, 1, 1, 1, 1, 0]


def test_a_refused_allocation_is_an_oom_and_its_free_is_skipped():
    prep = rp.prepare(events(40, 40))
    api = FakeDriverPool(capacity=64 * MiB)          # two chunks: the second 40 MiB fails
    cell = corpus.replay_on_driver_pool(prep, api)
    assert cell["num_ooms"] == 1
    assert [c[0] for c in api.calls] == ["alloc", "free"]
    assert api.closed == 1


def test_the_column_sits_beside_the_pool_in_both_halves(tmp_path):
    make_corpus(tmp_path, [("small", "tuning", events(20, 20, 2)),
                           ("large", "held-out", events(40, 40, 40))])
    api = FakeDriverPool()
    report = corpus.replay_corpus(tmp_path, driver_pool=api)
    assert report["columns"][-1] == corpus.DRIVER_POOL and report["notes"] == []
    small, large = (r["cells"][corpus.DRIVER_POOL] for r in report["rows"])
    assert small["peak_reserved_bytes"] == 64 * MiB
    assert large["peak_reserved_bytes"] == 128 * MiB            # 120 MiB: four chunks
    s = report["summary"]
    assert s["tuning"][corpus.DRIVER_POOL]["worst_ratio"] == pytest.approx(64 / 42)
    assert s["held-out"][corpus.DRIVER_POOL]["geomean_ratio"] == pytest.approx(128 / 120)
    text = corpus.format_report(report)
    assert corpus.DRIVER_POOL in text.splitlines()[2]               # a column's title
    assert f"{64 / 42:>9.3f}" in text and "ReservedMemHigh over peak live" in text
    # The pool's own columns are what they were without it.
    alone = corpus.replay_corpus(tmp_path, driver_pool=False)
    assert alone["columns"] == [c for c in report["columns"] if c != corpus.DRIVER_POOL]
    assert corpus.DRIVER_POOL not in corpus.format_report(alone)


def test_one_trace_failing_on_the_driver_is_its_cell_only(tmp_path):
    make_corpus(tmp_path, [("ok", "tuning", events(20)), ("bad", "tuning", events(6))])
    api = FakeDriverPool(fail_on=6 * MiB)
    report = corpus.replay_corpus(tmp_path, driver_pool=api)
    ok, bad = (r["cells"][corpus.DRIVER_POOL] for r in report["rows"])
    assert ok["peak_reserved_bytes"] == 32 * MiB
    assert bad == {"error": "RuntimeError: the driver failed"}
    assert api.opened == api.closed == 2                     # closed after the failure too
    assert report["summary"]["tuning"][corpus.DRIVER_POOL]["traces"] == 1
    assert "error: bad, driver pool: RuntimeError: the driver failed" in \
        corpus.format_report(report)


def test_off_the_device_the_column_is_left_out_with_a_line(tmp_path):
    assert corpus.driver_pool_for("sim") == (None, None)
    assert corpus.driver_pool_for("host") == (None, None)
    from mempool import _cuda
    if _cuda.available():
        pytest.skip("a CUDA device is here: the column runs")
    api, note = corpus.driver_pool_for("cuda")
    assert api is None and corpus.DRIVER_POOL in note and "no CUDA device" in note
    make_corpus(tmp_path, [("a", "tuning", events(20))])
    report = corpus.replay_corpus(tmp_path)                    # sim: no column, no line
    assert corpus.DRIVER_POOL not in report["columns"] and report["notes"] == []
