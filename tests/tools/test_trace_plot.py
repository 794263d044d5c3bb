"""Plots: segment maps from snapshots, timelines from replays, and the optional dependency."""
import os
import sys

import pytest

from mempool.tools import plot as mplot
from mempool.tools import replay as rp
from mempool.tools import trace as mt

from _trace_data import torch_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = os.path.join(REPO, "mempool", "traces", "small.jsonl")
PNG = b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install matplotlib"):
        mplot.plot(torch_snapshot(), tmp_path / "x.png")


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot() saves, as it saves them (their axes hold what was drawn)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    figures = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, *a, **k: figures.append(fig) or real(fig, *a, **k))
    return figures


def decoded(path):
    """The PNG as pixels (height x width x RGBA, floats in [0, 1]), read back by a decoder."""
    from matplotlib import image
    with open(path, "rb") as f:
        assert f.read(8) == PNG
    return image.imread(path)


def share_of(pixels, color, tol=0.02):
    """The share of pixels within `tol` of `color` (a matplotlib colour)."""
    import numpy as np
    from matplotlib.colors import to_rgb
    near = np.abs(pixels[..., :3] - np.array(to_rgb(color))).max(axis=-1) <= tol
    return float(near.mean())


def bars(ax, color):
    """[(row, left, width)] of the bars of one colour, in drawing order."""
    from matplotlib.colors import same_color
    return [(round(r.get_y() + r.get_height() / 2), r.get_x(), r.get_width())
            for r in ax.patches if same_color(r.get_facecolor()[:3], color)]


def test_segment_map_of_a_torch_snapshot(tmp_path, drawn):
    out = mplot.plot(torch_snapshot(), tmp_path / "map.png")
    pixels = decoded(out)
    # Two rows: 12 x (2.6 + 0.32 * 2) inches at 110 dpi.
    assert pixels.shape == (round((2.6 + 0.32 * 2) * 110), 12 * 110, 4)
    allocated, free = mplot.STATES["active_allocated"][1], mplot.STATES["inactive"][1]
    assert share_of(pixels, allocated) > 0.005 and share_of(pixels, free) > 0.05
    assert share_of(pixels, "white") < 0.95, "a blank picture"
    [fig] = drawn
    ax = fig.axes[0]
    # Largest segment first: the 20 MiB one with allocated blocks at 0-2 MiB and 3-4 MiB,
    # then the 2 MiB one with a 512 B block (drawn at least MIN_WIDTH wide).
    assert bars(ax, allocated) == [(0, 0.0, pytest.approx(0.1)), (0, pytest.approx(0.15),
                                   pytest.approx(0.05)), (1, 0.0, mplot.MIN_WIDTH)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stream 0x0, large",
                                                            "stream 0x0, small"]
    assert "2 segments, 22.00 MiB reserved" in ax.get_title()


def test_segment_map_of_the_pools_own_snapshot(tmp_path, drawn):
    import xml.etree.ElementTree as ET
    pool, ptrs = rp.pool_at(mt.load(SMALL))
    snap = pool.snapshot()
    out = mplot.plot(snap, tmp_path / "pool.svg")
    root = ET.parse(out).getroot()                   # a well-formed SVG, with shapes in it
    assert root.tag.endswith("svg") and len(root.findall(".//{*}path")) > 10
    ax = drawn[0].axes[0]
    segs = sorted(snap["segments"], key=lambda s: (s["stream"], -s["total_size"], s["address"]))
    assert 1 < len(segs) <= mplot.MAX_ROWS
    assert len(ax.get_yticklabels()) == len(segs)
    # Each row's allocated bars are that segment's allocated blocks, where they lie.
    allocated = bars(ax, mplot.STATES["active_allocated"][1])
    for y, seg in enumerate(segs):
        want, offset = [], 0
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                want.append((offset / seg["total_size"],
                             max(b["size"] / seg["total_size"], mplot.MIN_WIDTH)))
            offset += b["size"]
        got = [(left, width) for row, left, width in allocated if row == y]
        assert len(got) == len(want), y
        assert [float(v) for pair in got for v in pair] == \
            pytest.approx([v for pair in want for v in pair]), y
    assert allocated, "no allocated block drawn"
    for p in ptrs:
        pool.free(p)


def test_timeline_from_a_trace_or_a_result(tmp_path, drawn):
    import numpy as np
    tr = mt.load(SMALL)
    r = rp.replay(tr, timeseries=True)
    for source, name in ((tr, "a.png"), (r, "b.png")):
        pixels = decoded(mplot.plot(source, tmp_path / name))
        assert pixels.shape == (round(4.8 * 110), 11 * 110, 4)
        assert share_of(pixels, "#1f77b4", tol=0.05) > 0.001, "the live curve is missing"
        assert share_of(pixels, "white") < 0.95
    for fig in drawn:                                # both: the same replay, drawn the same
        ax = fig.axes[0]
        reserved, live = ax.get_lines()[:2]
        assert np.allclose(reserved.get_ydata(), np.array(r.timeseries["reserved_bytes"]) / 2**30)
        assert np.allclose(live.get_ydata(), np.array(r.timeseries["live_bytes"]) / 2**30)
        assert max(live.get_ydata()) == pytest.approx(r.peak_live_bytes / 2**30)
        assert f"{r.events} events on sim" in ax.get_title()
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


def test_plot_names_the_file_it_writes(tmp_path, capsys, monkeypatch):
    # matplotlib adds .png to a name without an extension: the path reported is that file.
    assert mplot.image_path(tmp_path / "NAME") == str(tmp_path / "NAME.png")
    assert mplot.image_path("map.svg") == "map.svg"
    from mempool.cli import trace as cli_trace
    monkeypatch.setattr(mplot, "plot", lambda path, out, conf=None: mplot.image_path(out))
    assert cli_trace.main("plot", [SMALL, "--out", str(tmp_path / "NAME")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "NAME.png")


@pytest.mark.parametrize("segment", [
    {"blocks": []},                                           # no total_size
    {"total_size": "big", "blocks": []},
    {"total_size": -1, "blocks": []},
    {"total_size": 1 << 20, "blocks": [{"state": "active_allocated"}]},   # a block's size
    {"total_size": 1 << 20, "blocks": 5},
    {"total_size": 1 << 20, "stream": [1], "blocks": []},
    [1, 2],
])
def test_plot_segments_with_bad_fields_is_a_value_error(tmp_path, segment):
    snap = torch_snapshot()
    snap["segments"].append(segment)
    with pytest.raises(ValueError, match=r"segments\[\d+\]"):
        mplot.plot_segments(snap, tmp_path / "map.png")
