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
           "Entry", "load_manifest", "replay_corpus", "format_report"]

FORMAT = "mempool-corpus"
VERSION = 1
HALVES = ("tuning", "held-out")
MANIFEST = "manifest.json"
DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "traces", "corpus")
# The pool's two modes: (label, Pool keywords).
DEFAULT_MODES = (("mempool", {}), ("mempool expandable", {"expandable_segments": True}))


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


def replay_corpus(directory=None, modes=DEFAULT_MODES, backend: str = "sim", limit=None,
                  torch_rows=(), **options) -> dict:
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

    Returns
    -------
    dict
        ``columns`` (the labels), ``rows`` (one per manifest entry, in its order: ``name``,
        ``half``, and for a recorded trace ``events``, ``peak_live_bytes``, ``steps`` and
        ``cells``, a dict of label -> the column's figures or ``error``; for a trace not
        recorded, ``missing``), and ``summary``: per half, per column, the geometric mean
        and the worst of peak reserved / peak live, the OOMs and the mean ns per event.
    """
    from mempool.tools import replay as rp
    from mempool.tools import trace as mtrace

    entries = load_manifest(directory)
    columns = [label for label, _ in modes] + [label for label, _ in torch_rows]
    rows = []
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
        for label, kwargs in modes:
            result = rp.replay(prep, backend=backend, limit=limit, **{**options, **kwargs})
            row["cells"][label] = _mode_cell(result)
        for label, run in torch_rows:
            row["cells"][label] = run(entry.path)
    return {"directory": DEFAULT_DIR if directory is None else os.fspath(directory),
            "backend": backend, "limit": limit, "columns": columns, "rows": rows,
            "summary": _summary(rows, columns)}


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
    return out


# ------------------------------------------------------------------------------------------
# the table

CELL = 22                     # width of one column's cell: ratio, OOMs, ns/event


def _cell(c) -> str:
    if c is None:
        return f"{'-':>{CELL}}"
    if "error" in c:
        return f"{'error':>{CELL}}"
    return f"{c['ratio']:>9.3f} {c.get('num_ooms', 0):>5} {c['ns_per_event']:>6,.0f}"


def format_report(report: dict) -> str:
    """The table of :func:`replay_corpus`: a line per trace, each half in its own block,
    then both halves' summaries side by side."""
    from mempool._units import format_bytes as fb

    cols = report["columns"]
    rows = report["rows"]
    counts = {h: sum(r["half"] == h for r in rows) for h in HALVES}
    missing = sum("missing" in r for r in rows)
    out = [f"corpus {report['directory']}: {len(rows)} traces ("
           + ", ".join(f"{counts[h]} {h}" for h in HALVES)
           + (f"; {missing} not recorded" if missing else "")
           + f"), replayed on {report['backend']}"
           + (f", limit {report['limit']}" if report.get("limit") is not None else ""),
           "each column: peak reserved / peak live (lower is better), OOMs, ns per event"]
    names = max([len(r["name"]) for r in rows] + [5])
    lead = f"{'half':<9} {'trace':<{names}} {'events':>8} {'peak live':>10}"
    out.append(" " * len(lead) + "".join(f"  {c[:CELL]:>{CELL}}" for c in cols))
    out.append(lead + f"  {'res/live  OOMs  ns/ev':>{CELL}}" * len(cols))
    errors = []
    for half in HALVES:
        for r in (r for r in rows if r["half"] == half):
            if "missing" in r:
                out.append(f"{half:<9} {r['name']:<{names}} {r['missing']}")
                continue
            out.append(f"{half:<9} {r['name']:<{names}} {r['events']:>8,} "
                       f"{fb(r['peak_live_bytes']):>10}"
                       + "".join(f"  {_cell(r['cells'].get(c))}" for c in cols))
            errors += [f"{r['name']}, {c}: {r['cells'][c]['error']}" for c in cols
                       if "error" in r["cells"].get(c, {})]
    out.append("")
    out.append("summary: geometric mean and worst of peak reserved / peak live, OOMs, mean "
               "ns per event, each half side by side")
    width = 8 + 8 + 6 + 8
    titles = [f"{h} ({report['summary'][h]['traces']} traces)" for h in HALVES]
    out.append((f"{'':<34}" + "".join(f"  {t:<{width}}" for t in titles)).rstrip())
    out.append((f"{'column':<34}" + f"  {'geomean   worst  OOMs   ns/ev':<{width}}"
                * len(HALVES)).rstrip())
    for c in cols:
        line = f"{c[:34]:<34}"
        for h in HALVES:
            s = report["summary"][h][c]
            if s["geomean_ratio"] is None:
                line += f"  {'(no trace)':<{width}}"
            else:
                line += (f"  {s['geomean_ratio']:>7.3f} {s['worst_ratio']:>7.3f} "
                         f"{s['num_ooms']:>5} {s['ns_per_event']:>7,.0f}")
        out.append(line.rstrip())
    out += [f"error: {e}" for e in errors]
    out.append("tuning: defaults and rules may be chosen on these; held-out: never used to "
               "choose")
    return "\n".join(out)
