"""Command line for traces: ``python -m mempool replay|tune|plot``.

    python -m mempool replay [TRACE] [--conf CONF] [--backend sim|cuda|host] [--limit N]
                             [--plot FILE] [--json] [--compare] [--corpus [DIR]]
                             [--processes N]
    python -m mempool tune   [TRACE] [--limit N] [--top N] [--quiet] [--segment-rounding SIZE]
    python -m mempool plot   [SNAPSHOT_OR_TRACE] [--out FILE.png] [--conf CONF] [--segments]

TRACE is a mempool trace (JSON lines, .gz allowed), a torch memory snapshot pickle, or an
RMM log CSV, recognised by content. Without one, each command uses the transformer trace
shipped with the package (mempool/traces/).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from mempool._core import _DEFAULT_CAPACITY
from mempool.cli._args import ArgumentParser

__all__ = ["main", "default_trace"]

# Package data (pyproject.toml), so an installed wheel has them too; the benchmark scripts
# and tests read them from here as well.
# The shipped traces live at the package root (mempool/traces), beside the tools that read them.
TRACES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "traces")
DEFAULT_TRACE = "transformer_train.jsonl.gz"
# The sim backend's default capacity: a host replay gets the same device size.
SIM_CAPACITY = _DEFAULT_CAPACITY["sim"]


def default_trace() -> str:
    """The shipped trace each command replays when given none."""
    path = os.path.join(TRACES_DIR, DEFAULT_TRACE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no trace given and the shipped default {path} is missing "
                                "(a broken installation: reinstall mempool, or pass a trace file)")
    return path


def _load(path: str):
    from mempool.tools import trace

    return trace.load_any(path)


def _size_arg(text: str):
    """--limit accepts bytes, a size string ("40GB") or a fraction of capacity ("0.5")."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text                  # a size string; the pool validates it
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fractional --limit must be in (0, 1]; got {text}")
    return value


def _processes_arg(text: str) -> int:
    """--processes: a whole number of processes per cell, from 1 to the cap."""
    from mempool.tools import corpus_processes

    try:
        return corpus_processes.parse_processes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _delays_arg(text: str) -> tuple:
    """--sim-delays: MAP,UNMAP in whole microseconds, each from 0 to 1 s; in nanoseconds."""
    parts = text.split(",")
    try:
        us = [int(p) for p in parts]
    except ValueError:
        us = []
    if len(us) != 2 or not all(0 <= u <= 1_000_000 for u in us):
        raise argparse.ArgumentTypeError(
            f"expected MAP,UNMAP in whole microseconds from 0 to 1000000 (such as 55,45); "
            f"got {text!r}")
    return us[0] * 1000, us[1] * 1000


def _replay(argv) -> int:
    from mempool.tools import replay as rp

    ap = ArgumentParser(prog="python -m mempool replay",
                                 description="Replay an allocation trace through a pool and "
                                             "report peak live and reserved memory.")
    ap.add_argument("trace", nargs="?", help=f"trace file (default: the shipped {DEFAULT_TRACE})")
    ap.add_argument("--conf", default=None,
                    help='pool options, as MEMPOOL_CONF takes them ("key:value,...")')
    ap.add_argument("--backend", default="sim", choices=rp.BACKENDS,
                    help="sim (default: simulated device at GPU scale), cuda (real device "
                         "memory, no kernels) or host")
    ap.add_argument("--limit", type=_size_arg, default=None,
                    help="cap on reserved bytes: bytes, a size (40GB) or a fraction (0.5)")
    ap.add_argument("--capacity", default=None,
                    help="memory of the device replayed on (a size: 80GB). Default: the "
                         "GPU's on cuda, 80 GiB on sim, and on host 80 GiB as on sim (the "
                         "host backend's own default, 4 GiB, would refuse a GPU-sized trace; "
                         "host segments reserve address space only, not memory)")
    ap.add_argument("--plot", metavar="FILE", default=None,
                    help="also draw live and reserved bytes over the replay to FILE (.png)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--compare", action="store_true",
                    help="replay with expandable segments off and on, side by side, and on "
                         "--backend cuda with PyTorch installed also through PyTorch's "
                         "caching allocator, default and expandable_segments:True (each in "
                         "a process of its own)")
    ap.add_argument("--corpus", nargs="?", const="", default=None, metavar="DIR",
                    help="replay every trace of a corpus (a folder with manifest.json; "
                         "default: the shipped mempool/traces/corpus) under both modes, and "
                         "on --backend cuda PyTorch's, its tuning and held-out halves side "
                         "by side")
    ap.add_argument("--processes", type=_processes_arg, default=None, metavar="N",
                    help="with --corpus: replay each cell (trace and column) in N fresh "
                         "processes, each pinned to one CPU, the columns' processes taking "
                         "turns; ns/event is their median, and the worst is shown beside it "
                         "(default 1: one replay per cell)")
    ap.add_argument("--sim-delays", type=_delays_arg, default=None, metavar="MAP,UNMAP",
                    help="on sim, every page map and unmap sleeps this many microseconds "
                         "(55,45 models a driver's), so that ns per event shows the driver's "
                         "time on the replaying thread, or on the mapper's with map_ahead")
    args = ap.parse_args(argv)
    if args.sim_delays is not None and (args.backend != "sim" or args.corpus is not None
                                        or args.compare):
        ap.error("--sim-delays applies to a single replay on --backend sim")
    if args.corpus is not None:
        return _corpus(ap, args)
    if args.processes is not None:
        ap.error("--processes times the cells of a corpus: give it with --corpus (a single "
                 "trace's replay is one process)")
    if args.compare and args.plot:
        ap.error("--compare draws no plot: give --plot without --compare")
    path = args.trace or default_trace()
    events = _load(path)
    capacity = args.capacity
    if capacity is None and args.backend == "host":
        capacity = SIM_CAPACITY
    extra = {} if capacity is None else {"capacity": capacity}
    if args.compare:
        return _compare(path, events, args, extra)
    result = rp.replay(events, conf=args.conf, backend=args.backend, limit=args.limit,
                       timeseries=bool(args.plot), sim_delays_ns=args.sim_delays, **extra)
    # Where the bytes beyond live ones lay at the peak (sim and host: the pool is read part
    # way through a replay of its own).
    at_peak = (rp.peak_excess(events, conf=args.conf, backend=args.backend, limit=args.limit,
                              **extra)
               if args.backend != "cuda" and result.peak_reserved_bytes else None)
    if args.json:
        d = result.to_dict()
        d.pop("timeseries", None)
        d["trace"] = path
        if at_peak:
            d["at_peak"] = at_peak
        print(json.dumps(d, indent=2, default=str))
    else:
        import mempool
        from mempool._units import format_bytes as fb

        # The device's size, so that OOMs can be read against it.
        probe = mempool.Pool(backend=args.backend, **extra)
        where = f"{result.backend}, capacity {fb(probe.capacity)}" + (
            " (host default raised to sim's: --capacity to change)"
            if args.backend == "host" and args.capacity is None else "")
        if args.limit is not None:
            where += f", limit {args.limit}"
        del probe
        empties = (f", {result.empty_cache_calls:,} empty_cache calls"
                   if result.empty_cache_calls else "")
        trims = f", {result.trim_calls:,} trim calls" if result.trim_calls else ""
        print(f"trace          {path} ({result.events:,} events, {result.allocs:,} allocs, "
              f"{result.frees:,} frees{empties}{trims})")
        print(f"settings       {args.conf or '(default)'} on {where}")
        print(f"peak live      {fb(result.peak_live_bytes, exact=True)}: the most the trace "
              "held at once (requested sizes)")
        print(f"peak allocated {fb(result.peak_allocated_bytes, exact=True)}: the same after "
              "the pool's rounding")
        print(f"peak reserved  {fb(result.peak_reserved_bytes, exact=True)}: the most the pool "
              "held from the device (lower is better)")
        print(f"reserved/live  {result.ratio:.3f} (1.000 = no overhead; lower is better)")
        if at_peak:
            print(f"at the peak    a {fb(at_peak['request_bytes'])} request grew the pool; "
                  f"just before it, {fb(at_peak['free_before_its_kind'])} lay free in "
                  f"{at_peak['request_kind'] or 'no'} segments of its stream, where it was "
                  f"looked for (the largest "
                  f"{fb(at_peak['largest_free_before_its_kind'])}); then "
                  f"{fb(at_peak['free_bytes'])} lay free in {at_peak['free_blocks']:,} cached "
                  f"blocks (the largest {fb(at_peak['largest_free_bytes'])}) and rounding had "
                  f"added {fb(at_peak['rounding_bytes'])} to live blocks")
        if result.driver_reserved_peak_bytes is not None:
            print(f"driver pool    {fb(result.driver_reserved_peak_bytes, exact=True)} at its "
                  f"peak, {result.driver_reserved_peak_bytes / result.peak_live_bytes:.3f} of "
                  "peak live: the device memory the cudaMemPool under the pool held at most")
        print(f"upstream calls {result.num_device_alloc:,} segment allocs, "
              f"{result.num_device_free:,} frees (each a cudaMalloc/cudaFree-class call on a "
              "GPU; fewer is better)")
        if result.options.get("map_ahead") and result.options.get("expandable_segments"):
            print(f"mapper         {result.stats['num_ahead_maps']:,} of the maps ahead of "
                  f"growth, {result.stats['num_behind_unmaps']:,} allocations unmapped behind "
                  "the release threshold, off the replaying thread")
        if result.steps:
            calls = result.calls_per_step
            syncs = max(step["stream_syncs"] for step in result.steps)
            print(f"calls per step {' '.join(map(str, calls))} ({len(calls)} steps; upstream "
                  f"calls in each training step, 0 once the pool is warm; at most {syncs} "
                  "stream syncs a step)")
        print(f"OOMs           {result.num_ooms:,} allocations refused (the replay went on "
              "without them)" + (f"; first: {result.first_oom}" if result.first_oom else ""))
        if result.unknown_frees or result.duplicate_allocs:
            print(f"trace issues   {result.unknown_frees} frees of unknown ids, "
                  f"{result.duplicate_allocs} allocs of ids already live")
        print(f"time           {result.ns_per_event:,.0f} ns per event of replay (this "
              "machine's CPU; lower is better)")
    if args.plot:
        from mempool.tools import plot

        written = plot.plot_timeline(result, args.plot, title=os.path.basename(path))
        print(f"plot           {written}")
    return 0


# Options that only fixed segments take: --compare's expandable row runs without them.
FIXED_SEGMENT_OPTIONS = ("segment_rounding",)

# The PyTorch rows of --compare: PYTORCH_CUDA_ALLOC_CONF for each.
TORCH_COMPARED = (("PyTorch default", ""),
                  ("PyTorch expandable_segments:True", "expandable_segments:True"))


def calls_per_step_text(calls) -> str:
    """Upstream calls in the first three steps, and the most in any later step."""
    if not calls:
        return "(no training steps marked)"
    return f"{' '.join(map(str, calls[:3]))}, then at most {max(calls[3:], default=0)}"


def _torch_row(path: str, torch_conf: str, cpu=None) -> dict:
    """One replay through PyTorch's caching allocator in a fresh process (PyTorch reads its
    configuration once, when CUDA starts), pinned to `cpu` where it is not None."""
    from mempool.tools import corpus_processes

    return corpus_processes.run_cell(corpus_processes.torch_cell(torch_conf), path, cpu)


def _torch_left_out(args, what: str):
    """Why PyTorch's rows or columns (`what`) cannot run beside the pool's, or None when they
    can: they need the cuda backend, no --limit (PyTorch has no such cap) and PyTorch."""
    import importlib.util

    if args.backend != "cuda":
        return (f"PyTorch's {what} need a GPU: give --backend cuda on a machine with CUDA "
                "and PyTorch")
    if args.limit is not None:
        return f"PyTorch's {what} are left out under --limit (PyTorch has no such cap)"
    if importlib.util.find_spec("torch") is None:
        return f"PyTorch's {what} are left out: PyTorch is not installed"
    return None


def _compare(path: str, events, args, extra: dict) -> int:
    """replay --compare: expandable segments off and on, and PyTorch's allocator where it can
    run, side by side: reserved / live, ns per event, upstream calls per step."""
    from mempool._config import parse_conf
    from mempool.tools import replay as rp

    rows = []
    # A bad --conf is refused as without --compare (one line, exit status 2).
    conf = parse_conf(args.conf, "--conf") if args.conf else {}
    # Options of fixed segments only: the expandable row leaves them out instead of refusing.
    fixed_only = sorted(k for k in conf if k in FIXED_SEGMENT_OPTIONS)
    for label, expandable in (("mempool", False), ("mempool expandable_segments", True)):
        row_conf = {k: v for k, v in conf.items() if not (expandable and k in fixed_only)}
        r = rp.replay(events, conf=row_conf, backend=args.backend, limit=args.limit,
                      expandable_segments=expandable, **extra)
        rows.append({"allocator": label, "ratio": r.ratio, "ns_per_event": r.ns_per_event,
                     "driver_reserved_peak_bytes": r.driver_reserved_peak_bytes,
                     "peak_reserved_bytes": r.peak_reserved_bytes,
                     "peak_live_bytes": r.peak_live_bytes, "num_ooms": r.num_ooms,
                     "num_device_alloc": r.num_device_alloc,
                     "num_device_free": r.num_device_free, "calls_per_step": r.calls_per_step})
    torch_note = _torch_left_out(args, "rows")
    if torch_note is None:
        for label, torch_conf in TORCH_COMPARED:
            rows.append({"allocator": label, **_torch_row(path, torch_conf)})
    if args.json:
        print(json.dumps({"trace": path, "backend": args.backend, "conf": args.conf,
                          "rows": rows, "note": torch_note}, indent=2, default=str))
        return 0
    print(f"trace          {path} ({len(events):,} events)")
    print(f"compared on    {args.backend}, settings {args.conf or '(default)'}"
          + (f", limit {args.limit}" if args.limit is not None else ""))
    print(f"{'allocator':<34} {'reserved/live':>13} {'ns/event':>9}  {'OOMs':>5}  "
          "upstream calls per step")
    for row in rows:
        if "error" in row:
            print(f"{row['allocator']:<34} error: {row['error']}")
            continue
        print(f"{row['allocator']:<34} {row['ratio']:>13.3f} {row['ns_per_event']:>9,.0f}  "
              f"{row.get('num_ooms', 0):>5}  {calls_per_step_text(row.get('calls_per_step'))}")
    for row in rows:
        driver = row.get("driver_reserved_peak_bytes")
        if driver is not None:
            print(f"{row['allocator']}: its cudaMemPool held {driver / row['peak_live_bytes']:.3f}"
                  " of peak live at its peak (the device memory under the pool's segments)")
    for row in rows:
        if row.get("trims_skipped"):
            print(f"{row['allocator']}: {row['trims_skipped']:,} trim calls skipped (they keep "
                  "some cached bytes, and PyTorch has no trim to N bytes; trims to 0 ran as "
                  "its empty_cache)")
    if fixed_only:
        print(f"mempool expandable_segments: without {', '.join(fixed_only)} (an option of "
              "fixed segments; expandable segments round each growth to their page)")
    if torch_note:
        print(torch_note)
    print("ns/event: " + ("the GPU's allocators against device memory" if args.backend == "cuda"
                          else f"this machine's CPU with the {args.backend} device's upstream; "
                               "compare the calls, not the ns, with a GPU's"))
    return 0


def _corpus(ap, args) -> int:
    """replay --corpus: every trace of a corpus under the pool's two modes (and PyTorch's
    allocator on cuda), the halves side by side (mempool/tools/corpus.py)."""
    from mempool._config import parse_conf
    from mempool.tools import corpus

    for flag, given in (("a TRACE", args.trace), ("--compare", args.compare),
                        ("--plot", args.plot)):
        if given:
            ap.error(f"--corpus replays the corpus's traces: give {flag} without --corpus")
    conf = parse_conf(args.conf, "--conf") if args.conf else {}
    # As --compare: options of fixed segments only are left out of the expandable column.
    fixed_only = [k for k in conf if k in FIXED_SEGMENT_OPTIONS]
    plain = {k: v for k, v in conf.items() if k not in fixed_only}
    modes = [(label, {**(plain if kw.get("expandable_segments") else conf), **kw})
             for label, kw in corpus.DEFAULT_MODES]
    note = _torch_left_out(args, "columns")
    torch_rows = [] if note else [
        (label, lambda path, cpu=None, c=torch_conf: _torch_row(path, c, cpu))
        for label, torch_conf in TORCH_COMPARED]
    capacity = args.capacity
    if capacity is None and args.backend == "host":
        capacity = SIM_CAPACITY
    extra = {} if capacity is None else {"capacity": capacity}
    report = corpus.replay_corpus(args.corpus or None, modes=modes, backend=args.backend,
                                  limit=args.limit, torch_rows=torch_rows,
                                  processes=args.processes or 1, **extra)
    report["note"] = note
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(corpus.format_report(report))
    if fixed_only:
        print(f"{corpus.DEFAULT_MODES[1][0]}: without {', '.join(fixed_only)} (an option of "
              "fixed segments)")
    if note:
        print(note)
    return 0


# tune's exit status when no setting fits under the limit: the report says so, and
# recommends none. (2 is an error: bad arguments or an unreadable trace.)
TUNE_NOTHING_FITS = 1


def _tune(argv) -> int:
    from mempool.tools import tune as tn

    ap = ArgumentParser(prog="python -m mempool tune",
                                 description="Replay a trace on the simulated device under a "
                                             "grid of settings and recommend the one that "
                                             "reserves least memory.",
                        epilog="Exit status: 0 with a recommendation; 1 when no setting "
                               "replays the trace without refused allocations (under "
                               "--limit), so none is recommended; 2 on an error.")
    ap.add_argument("trace", nargs="?", help=f"trace file (default: the shipped {DEFAULT_TRACE})")
    ap.add_argument("--limit", type=_size_arg, default=None,
                    help="replay under this cap on reserved bytes (bytes, 40GB, or 0.5)")
    ap.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--segment-rounding", default=None, metavar="SIZE",
                    help="replay fixed segments rounded as on the device tuned for: on cuda "
                         "the cudaMemPool's unit, 32MiB on an H200; not under --limit, where "
                         "fixed segments are plain (default: sim's plain segments)")
    args = ap.parse_args(argv)
    path = args.trace or default_trace()
    events = _load(path)
    try:
        results = tn.tune(events, limit=args.limit, progress=not args.quiet,
                          segment_rounding=args.segment_rounding)
    except ValueError as e:
        ap.error(str(e))
    replayed = sum(r.result is not None for r in results)
    print(f"trace {path}: {len(events):,} events, {replayed} settings replayed on sim"
          + (f" under a limit of {args.limit}" if args.limit is not None else "")
          + (f", fixed segments rounded to {args.segment_rounding}"
             if args.segment_rounding is not None and args.limit is None else "")
          + f" ({len(results) - replayed} refused, listed below)" * (replayed < len(results)))
    print(tn.report(results, top=args.top))
    # Nothing fits: the run worked but found no setting to recommend (said in the report).
    return 0 if tn.fits(results) else TUNE_NOTHING_FITS


def _plot(argv) -> int:
    from mempool.tools import plot as pl
    from mempool.tools import replay as rp

    ap = ArgumentParser(prog="python -m mempool plot",
                                 description="Draw a snapshot's segment map, or a trace's live "
                                             "and reserved memory over time.")
    ap.add_argument("input", nargs="?",
                    help=f"snapshot pickle or trace file (default: the shipped {DEFAULT_TRACE})")
    ap.add_argument("--out", default="mempool_plot.png", help="image file (default %(default)s)")
    ap.add_argument("--conf", default=None, help="pool options for replaying a trace")
    ap.add_argument("--segments", action="store_true",
                    help="for a trace: draw the segment map at the moment reserved bytes "
                         "reach their peak")
    args = ap.parse_args(argv)
    path = args.input or default_trace()
    if args.segments:
        events = _load(path)
        pool, ptrs = rp.pool_at(events, conf=args.conf)
        try:
            written = pl.plot_segments(pool.snapshot(), args.out,
                             title=f"{os.path.basename(path)}, {args.conf or 'default settings'}"
                                   ", when reserved bytes reach their peak")
        finally:
            for p in ptrs:
                pool.free(p)
    else:
        written = pl.plot(path, args.out, conf=args.conf)
    print(written)                   # the file written (.png added to a bare name)
    return 0


COMMANDS = {"replay": _replay, "tune": _tune, "plot": _plot}


def main(command: str, argv) -> int:
    """Run `command` ("replay", "tune" or "plot") with its arguments; return the exit code."""
    if command not in COMMANDS:
        print(f"mempool: {command!r} is not a trace command (accepted: "
              f"{', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    # A bad input raises: mempool.cli.main makes it one line and exit status 2.
    return COMMANDS[command](list(argv))
