"""Plots: segment maps from snapshots, timelines from replays, and the optional dependency."""
import os
import sys

import pytest

from mempool.tools import plot as mplot
from mempool.tools import replay as rp
from mempool.tools import trace as mt

from _trace_data import torch_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(REPO, "mempool", "traces", "small.jsonl")
PNG = b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install matplotlib"):
        mplot.plot(torch_snapshot(), tmp_path / "x.png")


def test_segment_map_of_a_torch_snapshot(tmp_path):
    pytest.importorskip("matplotlib")
    out = mplot.plot(torch_snapshot(), tmp_path / "map.png")
    assert open(out, "rb").read(8) == PNG


def test_segment_map_of_the_pools_own_snapshot(tmp_path):
    pytest.importorskip("matplotlib")
    pool, ptrs = rp.pool_at(mt.load(SMALL))
    out = mplot.plot(pool.snapshot(), tmp_path / "pool.svg")
    assert b"<svg" in open(out, "rb").read(400)
    for p in ptrs:
        pool.free(p)


def test_timeline_from_a_trace_or_a_result(tmp_path):
    pytest.importorskip("matplotlib")
    tr = mt.load(SMALL)
    assert open(mplot.plot(tr, tmp_path / "a.png"), "rb").read(8) == PNG
    r = rp.replay(tr, timeseries=True)
    assert open(mplot.plot(r, tmp_path / "b.png"), "rb").read(8) == PNG
    with pytest.raises(ValueError, match="no time series"):
        mplot.plot(rp.replay(tr), tmp_path / "c.png")


def test_empty_snapshot_is_refused(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no segments to draw"):
        mplot.plot({"segments": [], "device_traces": []}, tmp_path / "x.png")


def _png_size(path):
    import struct

    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG
    return struct.unpack(">II", head[16:24])


def test_segment_map_size_is_bounded_and_block_boundaries_are_drawn(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # 200 segments of 3 blocks each: once a 2,000+ px tall image with no boundaries.
    segs = [{"address": i << 30, "total_size": 6 << 20, "stream": 0, "segment_type": "large",
             "blocks": [{"size": 2 << 20, "state": "active_allocated"}] * 3}
            for i in range(200)]
    drawn = []
    from matplotlib.axes import Axes
    real = Axes.vlines
    monkeypatch.setattr(Axes, "vlines", lambda ax, x, *a, **k: drawn.append(list(x))
                        or real(ax, x, *a, **k))
    out = mplot.plot({"segments": segs}, tmp_path / "map.png")
    width, height = _png_size(out)
    assert height <= 1200 and width <= 1400
    assert len(drawn) == mplot.MAX_ROWS
    assert all(x == pytest.approx([1 / 3, 2 / 3]) for x in drawn)
