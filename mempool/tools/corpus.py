"""A corpus of traces in two halves: replay each through the pool's modes, side by side.

A corpus is a folder with a ``manifest.json``::

    {"format": "mempool-corpus", "version": 1,
     "traces": [{"name": "bert_finetune", "half": "tuning", "file": "bert_finetune.jsonl.gz",
                 ...provenance...}, ...]}

Each trace belongs to one half: ``tuning`` (defaults and rules may be chosen on these) or
``held-out`` (never used to choose; reported beside the tuning half, to show what a choice
does to workloads it was not made on). ``file`` is relative to the manifest's folder; an
entry whose file is absent is listed as not recorded, so a manifest can name its traces
before they exist. Other keys are provenance (script, arguments, card, versions, events,
peak live bytes, steps), kept as they are.

``python -m mempool replay --corpus [DIR]`` prints :func:`format_report` of
:func:`replay_corpus`; the shipped corpus is mempool/traces/corpus (its README says how it
was recorded and why the halves are what they are).
"""
from __future__ import annotations

import json
import math
import os

__all__ = ["FORMAT", "VERSION", "HALVES", "MANIFEST", "DEFAULT_DIR", "DEFAULT_MODES",
           "DRIVER_POOL", "Entry", "load_manifest", "replay_corpus", "format_report",
           "CudaDriverPool", "driver_pool_for", "replay_on_driver_pool"]

FORMAT = "mempool-corpus"
VERSION = 1
HALVES = ("tuning", "held-out")
MANIFEST = "manifest.json"
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "traces", "corpus")
# The pool's two modes: (label, Pool keywords).
DEFAULT_MODES = (("mempool", {}), ("mempool expandable", {"expandable_segments": True}))
# The column of the trace replayed straight on a fresh cudaMemPool, with no pool in between.
DRIVER_POOL = "driver pool"


class Entry(dict):
    """One trace of a manifest: its keys as written, and ``path``, the file's absolute
    path."""

    @property
    def path(self) -> str:
        return self["path"]

    @property
    def recorded(self) -> bool:
        return os.path.isfile(self["path"])


def load_manifest(directory=None) -> list:
    """The entries of ``DIR/manifest.json`` (`directory` default: the shipped corpus), in
    the manifest's order, each an :class:`Entry`.

    Raises
    ------
    ValueError
        Naming the manifest and the entry, for anything but a manifest of this format: a
        missing file, bad JSON, an unknown half, a missing or repeated name, a missing file
        name or one that leaves nothing to read.
    """
    directory = DEFAULT_DIR if directory is None else os.fspath(directory)
    where = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ValueError(f"--corpus: {directory!r} is not a folder (a corpus is a folder "
                         f"holding {MANIFEST} and the traces it lists)")
    try:
        with open(where, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--corpus: {directory!r} holds no {MANIFEST} (a corpus is a folder "
                         f"holding {MANIFEST} and the traces it lists)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f'{where}: not a corpus manifest (expected an object with "format": '
                         f'"{FORMAT}")')
    if data.get("version") != VERSION:
        raise ValueError(f"{where}: corpus version {data.get('version')!r} is not supported "
                         f"(this mempool reads version {VERSION})")
    traces = data.get("traces")
    if not isinstance(traces, list):
        raise ValueError(f'{where}: "traces" must be a list of entries; got '
                         f"{type(traces).__name__}")
    entries, names = [], set()
    for i, item in enumerate(traces):
        at = f"{where}: traces[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at}: an entry is an object; got {item!r:.80}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f'{at}: "name" must be a non-empty string; got {name!r:.80}')
        if name in names:
            raise ValueError(f"{at}: the name {name!r} is listed twice")
        names.add(name)
        if item.get("half") not in HALVES:
            raise ValueError(f'{at} ({name}): "half" must be one of {list(HALVES)}; got '
                             f"{item.get('half')!r:.80}")
        file = item.get("file")
        if not isinstance(file, str) or not file.strip() or os.path.isabs(file):
            raise ValueError(f'{at} ({name}): "file" must be a path relative to the '
                             f"manifest's folder; got {file!r:.80}")
        entries.append(Entry(item, path=os.path.normpath(os.path.join(directory, file))))
    return entries


def _mode_cell(result) -> dict:
    return {"ratio": result.ratio, "peak_reserved_bytes": result.peak_reserved_bytes,
            "num_ooms": result.num_ooms, "ns_per_event": result.ns_per_event}


# ------------------------------------------------------------------------------------------
# the driver pool column

class CudaDriverPool:
    """A fresh cudaMemPool on `device` per trace, through CuPy's runtime bindings
    (mempool._cuda): what :func:`replay_on_driver_pool` calls. Its release threshold is 0,
    CUDA's default, so what it holds at its high watermark is what the trace's own
    allocations needed of the device, chunks and all."""

    def __init__(self, device: int = 0):
        self.device = device
        self.handle = None
        self.streams = []
        self._keep = []

    def open(self, nstreams: int) -> None:
        import cupy

        from mempool import _cuda

        self.handle, _ = _cuda.resolve_pool_handle("create", self.device)
        _cuda.configure(self.handle, release_threshold=0)
        with cupy.cuda.Device(self.device):
            self._keep = [cupy.cuda.Stream(non_blocking=True) for _ in range(nstreams - 1)]
        self.streams = [0] + [s.ptr for s in self._keep]

    def alloc(self, nbytes: int, stream: int) -> int:
        """The address, or 0 when the device refuses (an out of memory)."""
        from mempool import _cuda

        try:
            return _cuda._runtime().mallocFromPoolAsync(nbytes, self.handle,
                                                         self.streams[stream])
        except Exception:
            return 0

    def free(self, ptr: int, stream: int) -> None:
        from mempool import _cuda

        _cuda._runtime().freeAsync(ptr, self.streams[stream])

    def empty(self) -> None:
        """The program's empty_cache: everything freed goes back to the device."""
        from mempool import _cuda

        _cuda.trim_to(self.handle, 0, sync_device=self.device)

    def close(self) -> int:
        """Destroy the pool once every free has run; returns its ReservedMemHigh."""
        from mempool import _cuda

        if self.handle is None:
            return 0
        try:
            _cuda.trim_to(self.handle, 0, sync_device=self.device)
            return _cuda.attributes(self.handle)["reserved_high"]
        finally:
            _cuda.destroy(self.handle)
            self.handle, self.streams, self._keep = None, [], []


def driver_pool_for(backend: str, device: int = 0):
    """``(api, note)`` for the driver pool column: on cuda where it can run a
    :class:`CudaDriverPool` and None; on cuda where it cannot, None and a line saying why
    (the column is left out, nothing fails); on other backends ``(None, None)``: the
    column is of the device only."""
    if backend != "cuda":
        return None, None
    from mempool import _cuda

    if not _cuda.available():
        return None, (f"the {DRIVER_POOL!r} column is left out: it replays each trace on a "
                      f"cudaMemPool, and no CUDA device with CuPy is available here")
    return CudaDriverPool(device), None


def replay_on_driver_pool(prep, api) -> dict:
    """Replay a prepared trace (mempool.tools.replay.prepare) straight on `api` (a
    :class:`CudaDriverPool`, or anything with its methods): each allocation one
    ``alloc(nbytes, stream)``, each free one ``free(ptr, stream)`` on the stream the trace
    frees on (the allocation's when it names none), the program's empty_cache and trim calls
    one ``empty()``. Returns the column's cell: ``ratio`` (``close()``'s high watermark over
    the trace's peak live bytes), ``peak_reserved_bytes``, ``num_ooms`` (allocations it
    refused, whose frees are skipped) and ``ns_per_event``.
    """
    import time

    from mempool.tools import replay as rp

    ops = prep.ops
    api.open(len(prep.streams))
    ptrs = [0] * prep.nslots
    where = [0] * prep.nslots
    ooms = 0
    calls = [at for at, _ in rp._cache_calls(prep.empty_cache_ops, prep.trim_ops, 0, len(ops))]
    try:
        t0 = time.perf_counter_ns()
        start = 0
        for i, stop in enumerate(calls + [len(ops)]):
            if i:   # every stretch after the first begins at one of the program's calls
                api.empty()
            for slot, nbytes, s in ops[start:stop]:
                if nbytes:
                    ptr = api.alloc(nbytes, s)
                    ooms += not ptr
                    ptrs[slot], where[slot] = ptr, s
                elif ptrs[slot]:
                    api.free(ptrs[slot], where[slot] if s is None else s)
                    ptrs[slot] = 0
            start = stop
        elapsed = time.perf_counter_ns() - t0
        for slot, ptr in enumerate(ptrs):
            if ptr:
                api.free(ptr, where[slot])
    finally:
        peak = api.close()
    live = prep.peak_live_bytes
    return {"ratio": peak / live if live else float("nan"), "peak_reserved_bytes": peak,
            "num_ooms": ooms, "ns_per_event": elapsed / max(1, len(ops))}


def replay_corpus(directory=None, modes=DEFAULT_MODES, backend: str = "sim", limit=None,
                  torch_rows=(), driver_pool=None, processes: int = 1, **options) -> dict:
    """Replay every recorded trace of the corpus in `directory` under each of `modes`.

    Parameters
    ----------
    modes : sequence of (label, dict)
        Each a column: its label and the Pool keywords of its replays.
    backend, limit, **options
        As :func:`mempool.tools.replay.replay` takes them, for every replay.
    torch_rows : sequence of (label, callable)
        Further columns from outside the pool: ``callable(path)`` returns a dict with
        ``ratio``, ``peak_reserved_bytes``, ``num_ooms`` and ``ns_per_event``, or
        ``error`` (``python -m mempool replay --corpus`` passes PyTorch's allocator here on
        cuda).
    driver_pool : optional
        The column :data:`DRIVER_POOL`: each trace replayed straight on a fresh cudaMemPool
        (:func:`replay_on_driver_pool`), its high watermark over peak live. None: as
        :func:`driver_pool_for` says (on cuda where it can run; where it cannot, left out
        with a line in ``notes``); False: left out; else the object to replay on.
    processes : int
        1: each cell is one replay, the pool's and the driver pool's in this process.
        More (at most :data:`mempool.tools.corpus_processes.MAX_PROCESSES`): each cell is
        replayed in that many fresh processes, each pinned to one CPU, the columns'
        processes in rounds (:mod:`mempool.tools.corpus_processes`); the cell's memory
        figures are its first process's, ``ns_per_event`` is the median over its processes
        and ``ns_per_event_worst`` the slowest, with ``n_processes``, ``ns_per_event_each``,
        ``children_agree`` and ``pinned``. `torch_rows`' callables are then called as
        ``callable(path, cpu=CPU)`` once per process, and `driver_pool` must be None,
        False or a :class:`CudaDriverPool` (its device is replayed on in the processes).

    Returns
    -------
    dict
        ``columns`` (the labels), ``rows`` (one per manifest entry, in its order: ``name``,
        ``half``, and for a recorded trace ``events``, ``peak_live_bytes``, ``steps`` and
        ``cells``, a dict of label -> the column's figures or ``error``; for a trace not
        recorded, ``missing``), ``summary``: per half, per column, the geometric mean
        and the worst of peak reserved / peak live, the OOMs and the mean ns per event
        (with more than one process, of the medians, and ``ns_per_event_worst`` the mean
        of the slowest), and ``notes``: lines on columns left out and on processes that
        could not be pinned. With more than one process also ``processes`` and
        ``pinned`` (whether every process of every cell ran on its CPU alone).
    """
    from mempool.tools import corpus_processes as cp
    from mempool.tools import replay as rp
    from mempool.tools import trace as mtrace

    error = cp.processes_error(processes)
    if error:
        raise ValueError(f"processes: {error}")
    entries = load_manifest(directory)
    notes = []
    if driver_pool is None:
        driver_pool, note = driver_pool_for(backend, options.get("device", 0))
        notes += [note] if note else []
    if processes > 1 and driver_pool and not isinstance(driver_pool, CudaDriverPool):
        raise ValueError("processes > 1 replays the driver pool column in processes of its "
                         "own, each on a fresh CudaDriverPool: pass driver_pool as None, "
                         "False or a CudaDriverPool")
    columns = [label for label, _ in modes] + [label for label, _ in torch_rows]
    if driver_pool:
        columns.append(DRIVER_POOL)
    rows, unpinned = [], False
    for entry in entries:
        row = {"name": entry["name"], "half": entry["half"]}
        rows.append(row)
        if not entry.recorded:
            row["missing"] = f"not recorded ({os.path.basename(entry.path)} is absent)"
            continue
        events = mtrace.load_any(entry.path)
        prep = rp.prepare(events)
        row.update(events=prep.events, peak_live_bytes=prep.peak_live_bytes,
                   steps=len(prep.step_ops) if prep.step_ops else 0, cells={})
        if processes > 1:
            row["cells"], pin_note = cp.run_rounds(
                _runners(entry.path, modes, torch_rows, driver_pool, backend, limit,
                         options), processes)
            if pin_note and pin_note not in notes:
                notes.append(pin_note)
            unpinned = unpinned or bool(pin_note)
            continue
        for label, kwargs in modes:
            result = rp.replay(prep, backend=backend, limit=limit, **{**options, **kwargs})
            row["cells"][label] = _mode_cell(result)
        for label, run in torch_rows:
            row["cells"][label] = run(entry.path)
        if driver_pool:
            try:
                row["cells"][DRIVER_POOL] = replay_on_driver_pool(prep, driver_pool)
            except Exception as e:   # one trace's failure is its cell's, not the table's
                row["cells"][DRIVER_POOL] = {"error": f"{type(e).__name__}: {e}"}
    report = {"directory": DEFAULT_DIR if directory is None else os.fspath(directory),
              "backend": backend, "limit": limit, "columns": columns, "rows": rows,
              "summary": _summary(rows, columns), "notes": notes}
    if processes > 1:
        report.update(processes=processes, pinned=not unpinned and all(
            c.get("pinned", False) for r in rows for c in r.get("cells", {}).values()
            if "error" not in c))
    return report


def _runners(path, modes, torch_rows, driver_pool, backend, limit, options) -> dict:
    """Each column's ``runner(cpu)``: one process of its cell of the trace at `path`
    (:func:`mempool.tools.corpus_processes.run_rounds`)."""
    from mempool.tools import corpus_processes as cp

    def child(cell):
        return lambda cpu: cp.run_cell(cell, path, cpu)

    runners = {label: child(cp.pool_cell(backend, limit, **{**options, **kwargs}))
               for label, kwargs in modes}
    for label, run in torch_rows:
        runners[label] = lambda cpu, run=run: run(path, cpu=cpu)
    if driver_pool:
        runners[DRIVER_POOL] = child(cp.driver_pool_cell(driver_pool.device))
    return runners


def _summary(rows, columns) -> dict:
    out = {}
    for half in HALVES:
        mine = [r for r in rows if r["half"] == half and "cells" in r]
        out[half] = {"traces": len(mine),
                     "not_recorded": sum(r["half"] == half and "missing" in r for r in rows)}
        for label in columns:
            cells = [r["cells"][label] for r in mine if "error" not in r["cells"][label]]
            ratios = [c["ratio"] for c in cells]
            out[half][label] = {
                "traces": len(cells),
                "geomean_ratio": (math.exp(sum(map(math.log, ratios)) / len(ratios))
                                  if ratios else None),
                "worst_ratio": max(ratios, default=None),
                "num_ooms": sum(c.get("num_ooms", 0) for c in cells),
                "ns_per_event": (sum(c["ns_per_event"] for c in cells) / len(cells)
                                 if cells else None)}
            if cells and all("ns_per_event_worst" in c for c in cells):
                out[half][label]["ns_per_event_worst"] = (
                    sum(c["ns_per_event_worst"] for c in cells) / len(cells))
    return out


# ------------------------------------------------------------------------------------------
# the table

CELL = 22                     # width of one column's cell: ratio, OOMs, ns/event
WORST = 7                     # and with several processes per cell, the slowest's ns/event


def _cell(c, worst: bool = False) -> str:
    width = CELL + WORST * worst
    if c is None:
        return f"{'-':>{width}}"
    if "error" in c:
        return f"{'error':>{width}}"
    return (f"{c['ratio']:>9.3f} {c.get('num_ooms', 0):>5} {c['ns_per_event']:>6,.0f}"
            + (f" {c['ns_per_event_worst']:>6,.0f}" if worst else ""))


def format_report(report: dict) -> str:
    """The table of :func:`replay_corpus`: a line per trace, each half in its own block,
    then both halves' summaries side by side."""
    from mempool._units import format_bytes as fb

    cols = report["columns"]
    rows = report["rows"]
    counts = {h: sum(r["half"] == h for r in rows) for h in HALVES}
    missing = sum("missing" in r for r in rows)
    n = report.get("processes", 1)
    worst = n > 1                     # each cell's median and slowest process
    width = CELL + WORST * worst
    out = [f"corpus {report['directory']}: {len(rows)} traces ("
           + ", ".join(f"{counts[h]} {h}" for h in HALVES)
           + (f"; {missing} not recorded" if missing else "")
           + f"), replayed on {report['backend']}"
           + (f", limit {report['limit']}" if report.get("limit") is not None else "")
           + (f", each cell in {n} processes "
              + ("pinned to one CPU each" if report.get("pinned") else "(not all pinned)")
              if worst else ""),
           "each column: peak reserved / peak live (lower is better), OOMs, ns per event"
           + (f" (the median of the {n} processes) and the worst process's" if worst else "")]
    names = max([len(r["name"]) for r in rows] + [5])
    lead = f"{'half':<9} {'trace':<{names}} {'events':>8} {'peak live':>10}"
    out.append(" " * len(lead) + "".join(f"  {c[:width]:>{width}}" for c in cols))
    heading = "res/live  OOMs  ns/ev" + "  worst" * worst
    out.append(lead + f"  {heading:>{width}}" * len(cols))
    errors = []
    for half in HALVES:
        for r in (r for r in rows if r["half"] == half):
            if "missing" in r:
                out.append(f"{half:<9} {r['name']:<{names}} {r['missing']}")
                continue
            out.append(f"{half:<9} {r['name']:<{names}} {r['events']:>8,} "
                       f"{fb(r['peak_live_bytes']):>10}"
                       + "".join(f"  {_cell(r['cells'].get(c), worst)}" for c in cols))
            errors += [f"{r['name']}, {c}: {r['cells'][c]['error']}" for c in cols
                       if "error" in r["cells"].get(c, {})]
    out.append("")
    out.append("summary: geometric mean and worst of peak reserved / peak live, OOMs, mean "
               "ns per event" + (" of the medians and of the worst processes" if worst else "")
               + ", each half side by side")
    width = 8 + 8 + 6 + 8 + 8 * worst
    titles = [f"{h} ({report['summary'][h]['traces']} traces)" for h in HALVES]
    out.append((f"{'':<34}" + "".join(f"  {t:<{width}}" for t in titles)).rstrip())
    heading = "geomean   worst  OOMs   ns/ev" + "   worst" * worst
    out.append((f"{'column':<34}" + f"  {heading:<{width}}" * len(HALVES)).rstrip())
    for c in cols:
        line = f"{c[:34]:<34}"
        for h in HALVES:
            s = report["summary"][h][c]
            if s["geomean_ratio"] is None:
                line += f"  {'(no trace)':<{width}}"
            else:
                line += (f"  {s['geomean_ratio']:>7.3f} {s['worst_ratio']:>7.3f} "
                         f"{s['num_ooms']:>5} {s['ns_per_event']:>7,.0f}"
                         + (f" {s['ns_per_event_worst']:>7,.0f}" if worst else ""))
        out.append(line.rstrip())
    out += [f"error: {e}" for e in errors]
    if DRIVER_POOL in cols:
        out.append(f"{DRIVER_POOL}: the trace's own allocations and frees straight on a fresh "
                   "cudaMemPool, its ReservedMemHigh over peak live (ns per event include "
                   "Python's call per event)")
    out += report.get("notes", [])
    out.append("tuning: defaults and rules may be chosen on these; held-out: never used to "
               "choose")
    return "\n".join(out)
