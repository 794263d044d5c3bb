"""``python -m mempool bench``: run the allocation latency suite and print one table.

The suite is the pytest-benchmark package ``mempool.bench`` (installed with mempool; it needs
the ``bench`` extra: pytest and pytest-benchmark). This command runs it
with benchmarks enabled, keeps pytest's own output in ``OUT/bench.log`` and the results in
``OUT/bench.json``, prints one table (ns per pair by allocator and size, each row's ratio to
mempool), and draws ``OUT/latency.png`` when matplotlib is installed. Without a CUDA device
it runs the simulated-device part only, and says so.
"""
import collections
import contextlib
import json
import os
import sys
from pathlib import Path

from mempool import _cuda
from mempool.cli._args import ArgumentParser

SECTION_ORDER = ["latency", "torch.empty", "foundation", "streams", "scale", "threads", "first step"]
SECTION_TEXT = {
    "latency": "one malloc+free pair by size",
    "torch.empty": "torch.empty + drop, each allocator in a process of its own",
    "foundation": "foundation targets on sim: the floor, an empty and a populated pool",
    "streams": "64 KiB pairs over several streams",
    "scale": "512 B pairs with many blocks live",
    "threads": "512 B pairs, Python threads at once (wall time per pair, all threads)",
    "first step": "first training iteration (model creation + one Adam step)",
}
# How figures of each unit are printed: (scale from ns, suffix).
UNITS = {"pair": (1.0, "ns per pair"), "iteration": (1e-3, "us per iteration"),
         "stream": (1.0, "ns per stream")}
# Times a contradicted figure is measured again before it is reported as noise.
NOISE_RETRIES = 3


def _unit_text(unit):
    """The header text of figures of `unit`: what they count, with the time unit."""
    return UNITS.get(unit, (1.0, f"ns per {unit}"))[1]
NO_GPU_FILTER = "sim or floor"


# ------------------------------------------------------------------------------------ table

def _sections(infos):
    """{section: (columns in order, rows in order, {(row, column): info})}."""
    by_section = collections.OrderedDict()
    for info in infos:
        by_section.setdefault(info.get("section", "other"), []).append(info)
    ordered = sorted(by_section, key=lambda s: (SECTION_ORDER.index(s)
                                                 if s in SECTION_ORDER else len(SECTION_ORDER)))
    result = collections.OrderedDict()
    for section in ordered:
        items = by_section[section]
        first = {}
        for i, info in enumerate(items):
            first.setdefault(info["column"], (info.get("order", i), i))
        columns = sorted(first, key=first.get)
        rows = list(dict.fromkeys(info["row"] for info in items))
        cells = {(info["row"], info["column"]): info for info in items}
        result[section] = (columns, rows, cells)
    return result


def _references(columns, rows, cells):
    """{column: (ref row, ns)}: the best-ranked mempool row measured in each column."""
    refs = {}
    for column in columns:
        ranked = [(cells[(r, column)]["ref"], r) for r in rows
                  if (r, column) in cells and cells[(r, column)].get("ref") is not None]
        if ranked:
            _, row = min(ranked)
            refs[column] = (row, cells[(row, column)]["ns"])
    return refs


def _figure(ns, unit):
    scale, _ = UNITS.get(unit, (1.0, unit))
    value = ns * scale
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _ratio(r):
    return f"x{r:,.0f}" if r >= 10 else f"x{r:.2g}"


def render_table(infos):
    """One text table of every measured figure: rows = allocators, columns = sizes/cases.

    Each cell is the median per unit, then ``xR``: the cell divided by the mempool
    reference row of the same section and column (named in the section's header line).
    """
    infos = [i for i in infos if i.get("ns") and i.get("row") and i.get("column")]
    if not infos:
        return "(no benchmark figures)"
    sections = _sections(infos)
    label_width = max(len(row) for _, rows, _ in sections.values() for row in rows) + 4
    lines = []
    for section, (columns, rows, cells) in sections.items():
        units = {c: next(info.get("unit", "pair") for (r, col), info in cells.items()
                         if col == c) for c in columns}
        unit = units[columns[0]]
        mixed = len(set(units.values())) > 1
        refs = _references(columns, rows, cells)
        body = {}
        for row in rows:
            for column in columns:
                info = cells.get((row, column))
                if info is None:
                    body[(row, column)] = "-"
                    continue
                text = _figure(info["ns"], units[column])
                if column in refs:
                    text += " " + _ratio(info["ns"] / refs[column][1])
                body[(row, column)] = text
        # Units in every header: the title's when the section has one, else each column's.
        heads = {c: f"{c} [{_unit_text(units[c])}]" if mixed else c for c in columns}
        widths = [max([len(heads[c])] + [len(body[(r, c)]) for r in rows]) for c in columns]
        ref_rows = sorted(set(r for r, _ in refs.values()))
        title = f"{section}: {SECTION_TEXT.get(section, '')}" + (
            "" if mixed else f" [{_unit_text(unit)}]")
        if ref_rows:
            title += f"; xR = relative to {' / '.join(ref_rows)}"
        lines.append("")
        lines.append(title)
        lines.append(" " * label_width + "  ".join(heads[c].rjust(w)
                                                   for c, w in zip(columns, widths)))
        for row in rows:
            cells_text = "  ".join(body[(row, c)].rjust(w) for c, w in zip(columns, widths))
            lines.append(f"  {row}".ljust(label_width) + cells_text)
    return "\n".join(lines[1:])


def _foundation(infos):
    """(columns, cells, floor row, empty-pool row, populated-pool row) of the foundation
    section, or None when it was not run."""
    sections = _sections([i for i in infos if i.get("ns")])
    if "foundation" not in sections:
        return None
    columns, rows, cells = sections["foundation"]
    floor = next((r for r in rows if "floor" in r), None)
    empty = next((r for r in rows if r.startswith("mempool alloc/free") and "empty" in r), None)
    full = next((r for r in rows if r.startswith("mempool alloc/free") and "cached" in r), None)
    return columns, cells, floor, empty, full


def contradictions(infos):
    """The foundation figures that contradict their own bounds: the bare-call floor above
    the round trip it bounds, or a pool holding 100k blocks faster than an empty one. Such
    a figure is noise (the machine was busy), not a result."""
    found = _foundation(infos)
    if found is None:
        return []
    columns, cells, floor, empty, full = found
    out = []
    for column in columns:
        ns = {name: cells[(row, column)]["ns"] for name, row in
              (("floor", floor), ("empty", empty), ("full", full))
              if row and (row, column) in cells}
        if "floor" in ns and "empty" in ns and ns["floor"] > ns["empty"]:
            out.append(f"{column}: the floor ({ns['floor']:,.0f} ns) measured above the "
                       f"round trip it bounds ({ns['empty']:,.0f} ns)")
        if "empty" in ns and "full" in ns and ns["full"] < ns["empty"]:
            out.append(f"{column}: the populated pool ({ns['full']:,.0f} ns) measured faster "
                       f"than the empty one ({ns['empty']:,.0f} ns)")
    return out


def foundation_lines(infos):
    """The foundation targets as sentences (sim, CPU only); figures that contradict their
    bounds are said to be noise, not given as results."""
    found = _foundation(infos)
    if found is None:
        return []
    noisy = contradictions(infos)
    if noisy:
        return ["foundation figures not reported: the machine was too noisy to measure them "
                f"(still after {NOISE_RETRIES} re-measurements): " + "; ".join(noisy)
                + ". Run again on a quiet machine."]
    columns, cells, floor, empty, full = found
    lines = []
    for column in columns:
        if floor and empty and (floor, column) in cells and (empty, column) in cells:
            f, e = cells[(floor, column)]["ns"], cells[(empty, column)]["ns"]
            lines.append(f"sim round trip {column}: {e:,.0f} ns = {e / f:.2f} x the bare-call "
                         f"floor ({f:,.0f} ns for two calls)")
        if empty and full and (empty, column) in cells and (full, column) in cells:
            e, p = cells[(empty, column)]["ns"], cells[(full, column)]["ns"]
            lines.append(f"sim round trip {column} with 100k live + 10k cached blocks: "
                         f"{p:,.0f} ns = {p / e:.2f} x the empty pool")
    return lines


def remeasure_noisy(infos, measure, retries=NOISE_RETRIES):
    """`infos` with the foundation section measured again (``measure()`` returns its new
    infos, or None when the run failed) while its figures contradict their bounds, at most
    `retries` times."""
    for _ in range(retries):
        if not contradictions(infos):
            break
        fresh = measure()
        if not fresh:
            break
        infos = [i for i in infos if i.get("section") != "foundation"] + [
            i for i in fresh if i.get("section") == "foundation"]
    return infos


# ------------------------------------------------------------------------------------- plot

def _ns_label(ns, _pos=None):
    for scale, unit in ((1e6, "ms"), (1e3, "\u00b5s"), (1.0, "ns")):
        if ns >= scale:
            return f"{ns / scale:g} {unit}"
    return f"{ns:g} ns"


def _bounds_125(lo, hi):
    """The 1-2-5 steps (..., 20, 50, 100, 200, ...) at or below `lo` and at or above `hi`."""
    import math

    def steps(n):
        for e in range(math.floor(math.log10(n)) - 1, math.floor(math.log10(n)) + 2):
            for m in (1, 2, 5):
                yield m * 10.0 ** e
    below = max(v for v in steps(lo) if v <= lo * (1 + 1e-9))
    above = min(v for v in steps(hi) if v >= hi * (1 - 1e-9))
    return below, above


def plot_latency(infos, path, note=None):
    """Draw latency by size per allocator (log scale) to `path`; return a message.

    `note`, when given, is added under the title (e.g. that no GPU rows were run).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed: no plot drawn (pip install matplotlib)"
    sections = _sections([i for i in infos if i.get("ns")])
    if "latency" not in sections:
        return "no latency figures: no plot drawn"
    columns, rows, cells = sections["latency"]
    if any(r.endswith("(cuda)") for r in rows):
        # With the GPU rows present the sim and host rows only crowd the plot (the table
        # keeps them).
        rows = [r for r in rows if not r.endswith(("(sim)", "(host)"))]
    fig, ax = plt.subplots(figsize=(12, 6.5 + 0.12 * max(0, len(rows) - 12)))
    tab = plt.get_cmap("tab20").colors
    colors = tab[0::2] + tab[1::2]     # the strong shades first: neighbours stay distinct
    markers = "osD^vP*Xph<>"
    for i, row in enumerate(rows):
        xs = [j for j, c in enumerate(columns) if (row, c) in cells]
        ys = [cells[(row, columns[j])]["ns"] for j in xs]
        mine = row.startswith("mempool") or row.startswith("cupy.empty on mempool")
        ax.plot(xs, ys, marker=markers[i % len(markers)], color=colors[i % len(colors)],
                linewidth=2.6 if mine else 1.3, linestyle="-" if mine else "--",
                markersize=7 if mine else 5, label=row)
    ax.set_yscale("log")
    # 1-2-5 steps: a run spanning one decade still gets several labelled ticks; the axis
    # runs from the 1-2-5 step at or below the fastest row to the one at or above the
    # slowest, so every plotted row lies between two labelled ticks (a 31 ns row once sat
    # below the lowest tick, 50 ns).
    plotted = [cells[(r, c)]["ns"] for r in rows for c in columns if (r, c) in cells]
    lower, upper = _bounds_125(min(plotted), max(plotted))
    ax.set_ylim(lower, upper)
    # Within about a decade, every integer step is labelled (20, 30, 40 ns ...).
    subs = (1.0, 2.0, 5.0) if upper / lower > 10 else tuple(float(m) for m in range(1, 10))
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_ns_label))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels([c.replace(", ", "\n") for c in columns])
    ax.set_xlim(-0.3, len(columns) - 0.7)
    ax.set_xlabel("allocation size")
    ax.set_ylabel("median time per malloc+free pair (log scale)")
    title = "Allocation latency by size: one malloc+free pair from Python\n" \
            "(solid: mempool; dashed: alternatives)"
    ax.set_title(title + (f"\n{note}" if note else ""))
    ax.grid(True, which="major", axis="y", alpha=0.5)
    ax.grid(True, which="minor", axis="y", alpha=0.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# -------------------------------------------------------------------------------------- run

def _bench_dir():
    # The suite ships inside the package, so an installed wheel runs the same files as a
    # source checkout.
    return Path(__file__).resolve().parent.parent / "bench"


class _Progress:
    """A pytest plugin: one character per benchmark on the terminal, skips and failures
    kept for the summary."""

    def __init__(self, stream):
        self.stream = stream
        self.skips = collections.Counter()
        self.failed = []
        self.count = 0

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skips[reason.removeprefix("Skipped: ")] += 1
            mark = "s"
        elif report.failed:
            self.failed.append(report.nodeid)
            mark = "F"
        elif report.when == "call":
            mark = "."
        else:
            return
        self.count += 1
        self.stream.write(mark + ("\n" if self.count % 80 == 0 else ""))
        self.stream.flush()


def _parser():
    p = ArgumentParser(prog="python -m mempool bench",
                                description="Run the allocation latency suite (mempool.bench) and "
                                            "print one table of ns per malloc+free pair.")
    p.add_argument("--quick", action="store_true",
                   help="3 rounds of 500 pairs instead of 7 of 2000, and no 10^6-block setups")
    p.add_argument("--out", default="mempool-bench", metavar="DIR",
                   help="folder for bench.json, bench.log, table.txt and latency.png "
                        "(default: ./mempool-bench)")
    p.add_argument("-k", dest="select", metavar="EXPR",
                   help="run only the benchmarks whose id matches this pytest -k expression")
    return p


def main(command, argv):
    """Entry point of ``python -m mempool bench``; returns the exit code."""
    args = _parser().parse_args(argv)
    bench_dir = _bench_dir()
    try:
        import pytest
        import pytest_benchmark  # noqa: F401  (the suite's timer)
    except ImportError as e:
        print(f"mempool bench: the suite runs under pytest-benchmark, which is missing "
              f"({e.name} is not installed): pip install 'mempool[bench]'", file=sys.stderr)
        return 2

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"mempool bench: --out {args.out}: cannot create this folder "
              f"({e.strerror or e})", file=sys.stderr)
        return 2
    json_path, log_path = out / "bench.json", out / "bench.log"
    if json_path.exists():
        json_path.unlink()

    gpu = _cuda.available()
    filters = [] if gpu else [NO_GPU_FILTER]
    if args.quick:
        filters.append("not live1e6")
    if args.select:
        filters.append(args.select)
    if not gpu:
        print("mempool bench: no CUDA device found: running the simulated-device (sim) part "
              "only; the GPU rows need a CUDA device.")
    print(f"mempool bench: running {bench_dir} ({'quick' if args.quick else 'full'}); "
          f"pytest output goes to {log_path}")

    pytest_args = [str(bench_dir), "--benchmark-enable", f"--benchmark-json={json_path}",
                   "-p", "no:cacheprovider", "-q"]
    if filters:
        pytest_args += ["-k", " and ".join(f"({f})" for f in filters)]
    terminal = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    progress = _Progress(terminal)
    saved_env = os.environ.get("MEMPOOL_BENCH_QUICK")
    os.environ["MEMPOOL_BENCH_QUICK"] = "1" if args.quick else "0"
    try:
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            rc = int(pytest.main(pytest_args, plugins=[progress]))
    finally:
        if saved_env is None:
            os.environ.pop("MEMPOOL_BENCH_QUICK", None)
        else:
            os.environ["MEMPOOL_BENCH_QUICK"] = saved_env
        terminal.write("\n")
        terminal.close()

    if not json_path.exists():
        print(f"mempool bench: pytest produced no results (exit {rc}); see {log_path}",
              file=sys.stderr)
        return rc or 1
    text = json_path.read_text()
    if not text.strip():   # pytest-benchmark leaves it empty when -k selected nothing
        print(f"mempool bench: no benchmark ran (exit {rc}); see {log_path}", file=sys.stderr)
        return rc or 1
    data = json.loads(text)
    infos = [b["extra_info"] for b in data.get("benchmarks", [])]

    def measure_foundation():
        again = out / "foundation-again.json"
        os.environ["MEMPOOL_BENCH_QUICK"] = "1" if args.quick else "0"
        try:
            with open(log_path, "a") as log, contextlib.redirect_stdout(log), \
                    contextlib.redirect_stderr(log):
                pytest.main([str(bench_dir / "test_foundation.py"), "--benchmark-enable",
                             f"--benchmark-json={again}", "-p", "no:cacheprovider", "-q"])
            return [b["extra_info"] for b in json.loads(again.read_text())["benchmarks"]]
        except (OSError, ValueError, KeyError):
            return None
        finally:
            if saved_env is None:
                os.environ.pop("MEMPOOL_BENCH_QUICK", None)
            else:
                os.environ["MEMPOOL_BENCH_QUICK"] = saved_env

    if contradictions(infos):
        print("mempool bench: foundation figures contradict their bounds (a busy machine?): "
              f"measuring them again, at most {NOISE_RETRIES} times")
        infos = remeasure_noisy(infos, measure_foundation)
    table = render_table(infos)
    sentences = foundation_lines(infos)
    print()
    print(table)
    if sentences:
        print()
        print("\n".join(sentences))
    (out / "table.txt").write_text(table + "\n" + "\n".join(sentences) + "\n")
    if progress.skips:
        print("\nnot measured:")
        for reason, n in progress.skips.most_common():
            print(f"  {n:4d} x {reason}")
    print()
    note = None if gpu else "no CUDA device here: simulated-device (sim) rows only"
    print(plot_latency(infos, out / "latency.png", note))
    print(f"results: {json_path}  table: {out / 'table.txt'}  log: {log_path}")
    if progress.failed:
        print(f"mempool bench: {len(progress.failed)} benchmark(s) failed:", file=sys.stderr)
        for nodeid in progress.failed:
            print(f"  {nodeid}", file=sys.stderr)
        return 1
    return 0 if rc in (0, 5) else rc
