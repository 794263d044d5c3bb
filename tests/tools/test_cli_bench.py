"""``python -m mempool bench``: the summary table, the plot, and one short end-to-end run."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mempool.cli import bench as cli_bench

ROOT = Path(__file__).resolve().parents[2]


def _info(row, column, ns, order=0, ref=None, section="latency", unit="pair"):
    return dict(section=section, row=row, column=column, ns=ns, order=order, ref=ref, unit=unit)


INFOS = [
    _info("bare C-method call x2 (floor)", "512 B", 70.0),
    _info("mempool alloc/free (sim)", "512 B", 140.0, ref=1),
    _info("mempool alloc/free (sim)", "64 KiB", 150.0, order=1, ref=1),
    _info("mempool alloc/free (cuda)", "512 B", 200.0, ref=0),
    _info("cudaMalloc + cudaFree", "512 B", 74000.0),
    _info("mempool (sim)", "cold", 250_000.0, section="first step", unit="iteration", ref=1),
]


def test_table_takes_ratios_against_the_best_ranked_mempool_row():
    lines = cli_bench.render_table(INFOS).splitlines()
    # The cuda row (rank 0) is the 512 B reference; only the sim row has 64 KiB.
    assert "relative to mempool alloc/free (cuda) / mempool alloc/free (sim)" in lines[0]
    assert lines[1].split() == ["512", "B", "64", "KiB"]
    cells = {}
    for line in lines[2:6]:
        label, *rest = re.split(r"\s{2,}", line.strip())
        cells[label] = rest
    assert cells == {
        "bare C-method call x2 (floor)": ["70.0 x0.35", "-"],
        "mempool alloc/free (sim)": ["140 x0.7", "150 x1"],
        "mempool alloc/free (cuda)": ["200 x1", "-"],
        "cudaMalloc + cudaFree": ["74,000 x370", "-"],
    }


def test_table_prints_iterations_in_microseconds_in_their_own_section():
    text = cli_bench.render_table(INFOS)
    section = text[text.index("first step:"):].splitlines()
    assert "[us per iteration]" in section[0]
    assert section[2].split()[-2:] == ["250", "x1"]


def test_table_without_figures_says_so():
    assert cli_bench.render_table([]) == "(no benchmark figures)"
    assert cli_bench.render_table([{"row": "a", "column": "b"}]) == "(no benchmark figures)"


def test_foundation_sentences_compare_floor_empty_and_populated():
    infos = [
        _info("bare C-method call x2 (floor)", "512 B", 70.0, section="foundation"),
        _info("mempool alloc/free (sim), empty pool", "512 B", 140.0, section="foundation",
              ref=1),
        _info("mempool alloc/free (sim), 100k live + 10k cached", "512 B", 175.0,
              section="foundation"),
    ]
    lines = cli_bench.foundation_lines(infos)
    assert lines == [
        "sim round trip 512 B: 140 ns = 2.00 x the bare-call floor (70 ns for two calls)",
        "sim round trip 512 B with 100k live + 10k cached blocks: 175 ns = 1.25 x the empty pool",
    ]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "latency.png"
    assert cli_bench.plot_latency(INFOS, path) == f"plot: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_option_is_refused_by_argparse():
    with pytest.raises(SystemExit) as exc:
        cli_bench.main("bench", ["--rounds", "3"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_end_to_end_quick_run_of_the_floor(tmp_path):
    """A real run through ``python -m mempool bench``, narrowed to the floor benchmarks."""
    out = tmp_path / "out"
    # Not an xdist worker's environment: pytest-benchmark disables itself when it sees one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(
        [sys.executable, "-m", "mempool", "bench", "--quick", "--out", str(out),
         "-k", "test_sim_floor"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bare C-method call x2 (floor)" in proc.stdout
    data = json.loads((out / "bench.json").read_text())
    figures = [b["extra_info"] for b in data["benchmarks"]]
    assert {f["column"] for f in figures} == {"512 B", "64 KiB"}
    assert all(f["ns"] > 0 and f["per_round"] == 500 for f in figures)
    assert (out / "table.txt").read_text().startswith("foundation:")


def test_the_latency_axis_reaches_every_row():
    # The H200 rows span 31 ns (the C loop) to 60 us: the axis once began at 50 ns.
    assert cli_bench._bounds_125(31.0, 59608.0) == (20.0, 100000.0)
    assert cli_bench._bounds_125(50.0, 200.0) == (50.0, 200.0)
    lo, hi = cli_bench._bounds_125(32.0, 90.0)
    assert (lo, hi) == (20.0, 100.0)


def test_plot_latency_labels_ticks_around_the_fastest_row(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seen = {}
    real = plt.Figure.savefig

    def capture(fig, *a, **k):
        ax = fig.axes[0]
        seen["ylim"] = ax.get_ylim()
        seen["ticks"] = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
        return real(fig, *a, **k)
    monkeypatch.setattr(plt.Figure, "savefig", capture)
    infos = [_info("mempool C loop (cuda)", "512 B", 32.0),
             _info("two bare C-method calls (floor)", "512 B", 41.0),
             _info("mempool alloc/free (cuda)", "512 B", 83.0, ref=0)]
    cli_bench.plot_latency(infos, tmp_path / "l.png")
    lo, hi = seen["ylim"]
    assert lo <= 32.0 and hi >= 83.0
    ticks = seen["ticks"]
    assert any(t <= 32.0 for t in ticks) and any(32.0 < t <= 41.0 for t in ticks)


def _foundation(floor, empty, full):
    return [
        _info("bare C-method call x2 (floor)", "512 B", floor, section="foundation"),
        _info("mempool alloc/free (sim), empty pool", "512 B", empty, section="foundation",
              ref=1),
        _info("mempool alloc/free (sim), 100k live + 10k cached", "512 B", full,
              section="foundation"),
    ]


def test_figures_that_contradict_their_bounds_are_noise_not_results():
    # A floor above the call it bounds, a populated pool faster than an empty one.
    noisy = _foundation(268.0, 77.0, 40.0)
    assert len(cli_bench.contradictions(noisy)) == 2
    lines = cli_bench.foundation_lines(noisy)
    assert len(lines) == 1 and "noisy" in lines[0], lines
    assert " x the " not in lines[0]                       # no ratio given as a result


def test_noisy_figures_are_measured_again():
    runs = [_foundation(268.0, 77.0, 90.0), _foundation(70.0, 140.0, 175.0)]
    again = cli_bench.remeasure_noisy(_foundation(268.0, 77.0, 40.0), lambda: runs.pop(0))
    assert not runs and not cli_bench.contradictions(again)
    assert cli_bench.foundation_lines(again)[0].startswith("sim round trip 512 B: 140 ns")
    calls = []
    cli_bench.remeasure_noisy(_foundation(268.0, 77.0, 90.0),
                              lambda: calls.append(1) or _foundation(268.0, 77.0, 90.0))
    assert len(calls) == cli_bench.NOISE_RETRIES


def test_every_header_names_its_unit():
    # The streams section holds ns per pair beside ns per stream (stream churn).
    infos = [_info("mempool (sim)", "2 streams", 150.0, section="streams", ref=1),
             _info("mempool (sim)", "stream churn", 900.0, section="streams", unit="stream")]
    text = cli_bench.render_table(infos)
    assert "2 streams [ns per pair]" in text and "stream churn [ns per stream]" in text, text
    assert "[stream]" not in text
    one_unit = cli_bench.render_table(INFOS)
    assert "[ns per pair]" in one_unit and "[us per iteration]" in one_unit


def test_an_out_folder_that_cannot_be_made_is_one_line(capsys):
    pytest.importorskip("pytest_benchmark")
    assert cli_bench.main("bench", ["--quick", "--out", "/proc/nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--out /proc/nope" in err, err
