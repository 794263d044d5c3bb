"""A model of the cudaMemPool behind the default path: what it holds for the pool's segments.

    python bench/driver_model.py                 # every candidate on both shipped traces
    python bench/driver_model.py --predict       # this build's segments under the fitting models
    python bench/driver_model.py --sequence transformer_train:32MiB   # the upstream calls
    python bench/driver_model.py --predict --kept  # releases kept behind busy streams
    python bench/driver_model.py --corpus        # the corpus, both halves side by side

On backend="cuda" each fixed segment is a ``cuMemAllocFromPoolAsync`` and a
``cuMemFreeAsync`` on a driver cudaMemPool; the device memory that cudaMemPool holds at most
is its ReservedMemHigh. The pool's own sequence of segment allocations and frees is the same
on sim as on cuda (the pool's peak reserved agrees exactly), so it is recorded here on sim
through ``Pool.record_history`` (``segment_alloc`` / ``segment_free`` entries: address, size,
stream, in the order the upstream sees them; a segment released to make room for a new one
is freed upstream before that allocation) and fed to a model of the driver.

A model places each allocation in one growing virtual address range and backs it with
physical chunks of ``chunk`` bytes (32 MiB on an H200): a chunk is held while any byte of it
is in use. Its knobs:

- ``fit``: ``"first"`` (the lowest free range that fits), ``"best"`` (the smallest free range
  that fits, the lowest of equals) or ``"bump"`` (no reuse of freed address ranges: always at
  the end);
- ``release``: ``"unmap"`` (a chunk wholly free no longer counts: given back, or kept and
  re-mapped under the next range that needs one, which holds the same at the peak) or
  ``"keep"`` (a chunk once touched stays held where it is, until the end);
- ``streams``: ``"shared"`` (one address range for every stream) or ``"per_stream"`` (one
  range, and one set of chunks, per stream);
- ``align_large``: allocations of at least one chunk start on a chunk boundary (``True``) or
  at the next byte (``False``).

Each candidate is checked against the probe facts of ``bench/driver_granularity.py``
(an earlier run (bench/results/ in git history)) and then against the six figures the H200 measured
for the shipped traces (:data:`MEASURED`). Those figures are of the pool as it was then
(`c479c4a`, small segments of 2 MiB under any rounding), whose upstream sequences are kept
in ``driver_model_sequences.json.gz`` (written by :func:`upstream_sequence` on that build), so
that the check does not move when the pool's segments change; ``--predict`` applies the
models to this build's own sequences.
"""
from __future__ import annotations

import argparse
import bisect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1 << 20
CHUNK = 32 * MiB
TRACES = ("transformer_train", "vision_train")
SETTINGS = (None, "32MiB", "64MiB")   # segment_rounding; None = plain segments on sim

# an earlier run (bench/results/ in git history): the cudaMemPool's peak over the trace's peak live
# bytes on the H200, and the pool's own peak reserved over peak live (sim reproduces it).
MEASURED = {
    ("transformer_train", None): (1.084, 1.036),
    ("transformer_train", "32MiB"): (1.059, 1.047),
    ("transformer_train", "64MiB"): (1.054, 1.051),
    ("vision_train", None): (1.119, 1.041),
    ("vision_train", "32MiB"): (1.089, 1.042),
    ("vision_train", "64MiB"): (1.066, 1.034),
}


# ----------------------------------------------------------------------------- the sequence

def trace_path(name: str) -> str:
    return os.path.join(ROOT, "mempool", "traces", f"{name}.jsonl.gz")


def upstream_sequence(trace, conf=None):
    """The pool's segment allocations and frees on sim for a trace (a name of a shipped trace,
    a path, or a prepared trace) under `conf` (a dict of Pool options).

    Returns ``(seq, info)``: ``seq`` a list of ``(op, seg, nbytes, stream)`` with op
    ``"alloc"`` or ``"free"``, ``seg`` the segment's number in allocation order (a free names
    the segment it gives back), ``stream`` the trace's stream index; ``info`` a dict of
    ``peak_live``, ``peak_reserved`` (the pool's own, from the replay) and ``event_of`` (for
    each entry of ``seq``, the number of trace events replayed before it).
    """
    import mempool
    from mempool.tools import replay as rp

    if isinstance(trace, str) and trace in TRACES:
        trace = trace_path(trace)
    prep = rp.prepare(trace)
    pool = rp._make_pool(conf or {}, "sim", None, {})
    pool.record_history(True, 4 * len(prep.ops) + 1024)   # a few entries per event at most
    handles, _ = rp._device_streams(prep, "sim")
    ptrs = [0] * prep.nslots
    oom = mempool.OutOfMemoryError
    ooms = []
    rp._run(pool, prep.ops, handles, ptrs, oom, ooms, 0, prep.empty_cache_ops, prep.trim_ops)
    seq, event_of = [], []
    by_addr = {}
    seen = 0
    events = 0   # trace events replayed so far: each alloc and free call is one entry
    for action, ptr, nbytes, stream, _t in pool.history():
        if action in ("alloc", "free_requested"):
            events += 1
            continue
        if action == "segment_alloc":
            seg = seen
            seen += 1
            by_addr[ptr] = seg
            seq.append(("alloc", seg, int(nbytes), int(stream)))
        elif action == "segment_free":
            seq.append(("free", by_addr.pop(ptr), int(nbytes), int(stream)))
        else:
            continue
        event_of.append(events)
    if events != len(prep.ops):
        raise RuntimeError(f"upstream_sequence: the history holds {events} of "
                           f"{len(prep.ops)} events (its ring wrapped)")
    if ooms:
        raise RuntimeError(f"upstream_sequence: {len(ooms)} OOMs on sim")
    stats = pool.stats()
    info = {"peak_live": prep.peak_live_bytes,
            "peak_reserved": int(stats["reserved_bytes.all.peak"]),
            "num_device_alloc": int(stats["num_device_alloc"]),
            "num_device_free": int(stats["num_device_free"]),
            "event_of": event_of}
    if info["num_device_alloc"] != sum(op == "alloc" for op, *_ in seq):
        raise RuntimeError("upstream_sequence: the history missed segment allocations")
    for p in ptrs:
        if p:
            pool.free(p)
    return seq, info


def conf_for(rounding):
    return {} if rounding in (None, "2MiB") else {"segment_rounding": rounding}


# ----------------------------------------------------------------------------- the model

class _Space:
    """One growing address range: free ranges as sorted, disjoint [start, end) pairs below
    ``top``, everything from ``top`` up free. Each free range carries the step at which it
    took its present shape (freed, merged or left over from a split), for ``ties="oldest"``
    / ``"newest"``."""

    def __init__(self):
        self.starts = []
        self.ends = []
        self.made = []
        self.top = 0
        self.clock = 0

    def _key(self, i, fit, ties):
        size = self.ends[i] - self.starts[i]
        tie = {"low": self.starts[i], "high": -self.starts[i], "oldest": self.made[i],
               "newest": -self.made[i]}[ties]
        return (self.starts[i],) if fit == "first" else (size, tie)

    def take(self, n, fit, align, ties="low"):
        self.clock += 1
        best = None
        if fit != "bump":
            for i in range(len(self.starts)):
                a = -(-self.starts[i] // align) * align
                if a + n > self.ends[i]:
                    continue
                if best is None or self._key(i, fit, ties) < self._key(best, fit, ties):
                    best = i
        if best is not None:
            s, e = self.starts[best], self.ends[best]
            a = -(-s // align) * align
            self._remove(best)
            if a + n < e:
                self._insert(a + n, e)
            if s < a:
                self._insert(s, a)
            return a
        # At the end: a free range touching the top merges with the space above it.
        s = self.top
        if fit != "bump" and self.ends and self.ends[-1] == self.top:
            s = self.starts[-1]
            self._remove(len(self.starts) - 1)
        a = -(-s // align) * align
        if s < a:
            self._insert(s, a)
        self.top = a + n
        return a

    def _remove(self, i):
        del self.starts[i], self.ends[i], self.made[i]

    def _insert(self, s, e):
        i = bisect.bisect_left(self.starts, s)
        self.starts.insert(i, s)
        self.ends.insert(i, e)
        self.made.insert(i, self.clock)

    def give(self, a, n):
        self.clock += 1
        s, e = a, a + n
        i = bisect.bisect_left(self.starts, s)
        if i > 0 and self.ends[i - 1] == s:   # merge with the range below
            i -= 1
            s = self.starts[i]
            self._remove(i)
        if i < len(self.starts) and self.starts[i] == e:   # and the one above
            e = self.ends[i]
            self._remove(i)
        self._insert(s, e)


class DriverModel:
    """A cudaMemPool as a model: ``alloc(seg, nbytes, stream)``, ``free(seg)``, ``held``
    (bytes of physical chunks it holds now) and ``peak`` (the most it held)."""

    def __init__(self, fit="first", release="unmap", streams="shared", chunk=CHUNK,
                 align=512, align_large=False, ties="low"):
        if fit not in ("first", "best", "bump"):
            raise ValueError(f"fit must be first, best or bump; got {fit!r}")
        if ties not in ("low", "high", "oldest", "newest"):
            raise ValueError(f"ties must be low, high, oldest or newest; got {ties!r}")
        if release not in ("unmap", "keep"):
            raise ValueError(f"release must be unmap or keep; got {release!r}")
        if streams not in ("shared", "per_stream"):
            raise ValueError(f"streams must be shared or per_stream; got {streams!r}")
        self.fit, self.release, self.streams = fit, release, streams
        self.chunk, self.align, self.align_large = chunk, align, align_large
        self.ties = ties
        self.spaces = {}
        self.where = {}      # seg -> (space key, address, nbytes)
        self.use = {}        # (space key, chunk index) -> bytes in use
        self.mapped = set()  # (space key, chunk index) held ("keep": every one touched)
        self.peak = 0

    @property
    def held(self):
        return len(self.mapped) * self.chunk

    def _chunks(self, key, a, n):
        c = self.chunk
        for k in range(a // c, (a + n - 1) // c + 1):
            lo = max(a, k * c)
            hi = min(a + n, (k + 1) * c)
            yield (key, k), hi - lo

    def alloc(self, seg, nbytes, stream=0):
        key = stream if self.streams == "per_stream" else 0
        space = self.spaces.get(key)
        if space is None:
            space = self.spaces[key] = _Space()
        align = self.chunk if self.align_large and nbytes >= self.chunk else self.align
        a = space.take(nbytes, self.fit, align, self.ties)
        self.where[seg] = (key, a, nbytes)
        for ck, part in self._chunks(key, a, nbytes):
            self.use[ck] = self.use.get(ck, 0) + part
            self.mapped.add(ck)
        self.peak = max(self.peak, self.held)
        return a

    def free(self, seg):
        key, a, n = self.where.pop(seg)
        self.spaces[key].give(a, n)
        for ck, part in self._chunks(key, a, n):
            left = self.use[ck] - part
            if left:
                self.use[ck] = left
            else:
                del self.use[ck]
                if self.release == "unmap":
                    self.mapped.discard(ck)


def peak_held(seq, kept=False, **model):
    """The most bytes the modelled cudaMemPool holds over an upstream sequence.

    With `kept`, the chunks that the frees just before an allocation give up still count
    during it: what the driver holds when those frees wait behind work still running on
    their stream and nothing synchronizes it, the pool before Note [Released before a
    growth] (mp_core.c) in a training loop. The address ranges are free for the allocation
    all the same (same-stream reuse)."""
    m = DriverModel(**model)
    freed = set()   # chunks given up since the last allocation
    for op, seg, nbytes, stream in seq:
        if op == "alloc":
            m.alloc(seg, nbytes, stream)
            if kept:
                m.peak = max(m.peak, len(m.mapped | freed) * m.chunk)
                freed = set()
        else:
            before = set(m.mapped) if kept else None
            m.free(seg)
            if kept:
                freed |= before - m.mapped
    return m.peak


CANDIDATES = {
    "first fit, unmap": dict(fit="first", release="unmap"),
    "first fit, keep": dict(fit="first", release="keep"),
    "first fit, unmap, per stream": dict(fit="first", release="unmap", streams="per_stream"),
    "best fit (ties: lowest address), unmap": dict(fit="best", ties="low"),
    "best fit (ties: highest address), unmap": dict(fit="best", ties="high"),
    "best fit (ties: oldest range), unmap": dict(fit="best", ties="oldest"),
    "best fit (ties: newest range), unmap": dict(fit="best", ties="newest"),
    "best fit (ties: highest address), keep": dict(fit="best", ties="high", release="keep"),
    "best fit (ties: highest address), unmap, per stream": dict(fit="best", ties="high",
                                                                streams="per_stream"),
    "bump (no reuse of freed ranges), unmap": dict(fit="bump"),
    "first fit, unmap, large ones chunk-aligned": dict(fit="first", align_large=True),
    "best fit (ties: highest address), unmap, large ones chunk-aligned":
        dict(fit="best", ties="high", align_large=True),
}
# The candidates that reproduce every probe fact and all six H200 figures (in chunks).
FITTING = ("best fit (ties: highest address), unmap", "best fit (ties: oldest range), unmap")


# ----------------------------------------------------------------------------- probe facts

def held_after(steps, **model):
    """MiB held after each allocation of `steps`, ``(op, seg, mib)`` with op "alloc" or
    "free" (whose mib is ignored), as bench/driver_granularity.py reports a case."""
    m = DriverModel(**model)
    out = []
    for op, seg, mib in steps:
        if op == "alloc":
            m.alloc(seg, mib * MiB)
            out.append(m.held // MiB)
        else:
            m.free(seg)
    return out


def probe_facts(**model):
    """The probe cases of bench/driver_granularity.py under a model, in MiB, as the probe
    reports them: one allocation; after each of a run of one size; free then grow."""
    def run(steps):
        return held_after(steps, **model)
    one = {mib: run([("alloc", 0, mib)])[0]
           for mib in (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 30, 32, 34, 40, 48, 64, 96, 100, 128,
                       200, 256)}
    runs = {mib: run([("alloc", i, mib) for i in range(8)]) for mib in (2, 4, 6, 12, 20, 40)}
    grow = {(a, b): run([("alloc", 0, a), ("free", 0, 0), ("alloc", 1, b)])[-1]
            for a, b in ((20, 40), (32, 64), (40, 60), (64, 96), (96, 128))}
    return one, runs, grow


def check_probe_facts(**model):
    """The measured probe facts the model misses (an empty list: it reproduces them)."""
    one, runs, grow = probe_facts(**model)
    misses = []
    for mib, held in one.items():
        want = max(32, -(-mib // 32) * 32)
        if held != want:
            misses.append(f"one allocation of {mib} MiB: {held}, measured {want}")
    for mib, n, want in ((6, 5, 32), (6, 6, 64)):
        if runs[mib][n - 1] != want:
            misses.append(f"{n} x {mib} MiB: {runs[mib][n - 1]}, measured {want}")
    if runs[12][:6] != [32, 32, 64, 64, 64, 96]:
        misses.append(f"12 MiB run: {runs[12][:6]}, measured [32, 32, 64, 64, 64, 96]")
    if grow[(32, 64)] != 64:
        misses.append(f"32 freed then 64: {grow[(32, 64)]}, measured 64")
    return misses


# ----------------------------------------------------------------------------- evaluation

_SEQ_CACHE = {}
SEQUENCES_FILE = os.path.join(HERE, "driver_model_sequences.json.gz")
_MEASURED_SEQS = {}


def measured_sequence(name, rounding):
    """The upstream sequence the pool made at the commit MEASURED is of, as ``sequence``
    returns it (without ``event_of``)."""
    if not _MEASURED_SEQS:
        import gzip
        import json
        with gzip.open(SEQUENCES_FILE, "rt") as f:
            saved = json.load(f)["sequences"]
        ops = {"a": "alloc", "f": "free"}
        for key, v in saved.items():
            _MEASURED_SEQS[key] = ([(ops[op], seg, n, st) for op, seg, n, st in v["seq"]],
                                   {k: v[k] for k in ("peak_live", "peak_reserved",
                                                      "num_device_alloc")})
    return _MEASURED_SEQS[f"{name}:{_label(rounding)}"]


def sequence(name, rounding, conf=None):
    key = (name, rounding, tuple(sorted((conf or {}).items())))
    if key not in _SEQ_CACHE:
        c = conf_for(rounding)
        c.update(conf or {})
        _SEQ_CACHE[key] = upstream_sequence(name, c)
    return _SEQ_CACHE[key]


def figures(model, settings=SETTINGS, traces=TRACES, current=False):
    """{(trace, rounding): (device peak / peak live under the model, pool peak / peak
    live)}, for the sequences MEASURED is of, or with `current` this build's."""
    out = {}
    for name in traces:
        for rounding in settings:
            seq, info = (sequence if current else measured_sequence)(name, rounding)
            out[(name, rounding)] = (peak_held(seq, **model) / info["peak_live"],
                                     info["peak_reserved"] / info["peak_live"])
    return out


def _label(rounding):
    return "plain" if rounding is None else rounding


def _chunks_off(name, rounding, fig):
    """' (+3)': how many 32 MiB chunks the model holds above the measured peak (the figures
    have three decimals, a quarter of a chunk or less on both traces, so the measured count
    is exact)."""
    live = measured_sequence(name, rounding)[1]["peak_live"]
    off = round((fig[(name, rounding)][0] - MEASURED[(name, rounding)][0]) * live / CHUNK)
    return f" ({off:+d})" if off else ""


def candidates_table():
    lines = ["| model | probe facts | " + " | ".join(
        f"{t.split('_')[0]} {_label(r)}" for t in TRACES for r in SETTINGS) +
        " | largest miss |",
        "|---|---|" + "---|" * (len(TRACES) * len(SETTINGS)) + "---|"]
    lines.append("| **H200 measured** | | " + " | ".join(
        f"{MEASURED[(t, r)][0]:.3f}" for t in TRACES for r in SETTINGS) + " | |")
    lines.append("| pool's own peak (sim) | | " + " | ".join(
        f"{figures(CANDIDATES['first fit, unmap'])[(t, r)][1]:.3f}"
        for t in TRACES for r in SETTINGS) + " | |")
    for label, model in CANDIDATES.items():
        misses = check_probe_facts(**model)
        fig = figures(model)
        worst = max(abs(fig[k][0] - MEASURED[k][0]) for k in MEASURED)
        lines.append(f"| {label} | {'all' if not misses else f'{len(misses)} missed'} | " +
                     " | ".join(f"{fig[(t, r)][0]:.3f}" + _chunks_off(t, r, fig)
                                for t in TRACES for r in SETTINGS) +
                     f" | {worst:.3f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- predictions

PREDICT_SETTINGS = (None, "16MiB", "32MiB", "48MiB", "64MiB", "96MiB", "128MiB")


def predictions_table(models=FITTING + ("first fit, unmap",), settings=PREDICT_SETTINGS,
                      traces=TRACES, kept=False):
    """This build's segments on each trace (a shipped trace's name, or a path of any trace
    `python -m mempool replay` reads, e.g. a PyTorch snapshot from bench/torch_workloads.py
    --snapshot) under each segment_rounding: the pool's own peak / live, then the device's
    under each of `models`, and the segment allocations. With `kept`, the device's as
    :func:`peak_held` with ``kept=True`` gives it."""
    head = " / ".join(["pool"] + [f"model {i + 1}" for i in range(len(models))])
    names = [os.path.basename(t).split(".")[0].split("_")[0] for t in traces]
    lines = ["| segment_rounding | " + " | ".join(f"{n}: {head} (segment allocs)" for n in names)
             + " |", "|---|" + "---|" * len(traces)]
    for rounding in settings:
        cells = []
        for name in traces:
            seq, info = sequence(name, rounding)
            live = info["peak_live"]
            devs = [peak_held(seq, kept=kept, **CANDIDATES[m]) / live for m in models]
            cells.append(" / ".join(f"{x:.3f}" for x in [info["peak_reserved"] / live] + devs)
                         + f" ({info['num_device_alloc']})")
        lines.append(f"| {_label(rounding)} | " + " | ".join(cells) + " |")
    models_line = "; ".join(f"model {i + 1}: {m}" for i, m in enumerate(models))
    if kept:
        models_line += ("; each keeping the chunks freed just before an allocation during it "
                        "(busy streams, no sync)")
    return "\n".join(lines + ["", models_line])


# ----------------------------------------------------------------------------- the corpus

def corpus_figures(directory=None, settings=(None, "32MiB"), model=FITTING[0]):
    """Each recorded trace of a corpus (mempool/tools/corpus.py; default: the shipped one)
    under each segment_rounding: ``{"rows": [{"name", "half", "cells": {label: (pool peak
    / live, device peak / live, segment allocations)}}], "summary": {half: {label:
    (geometric mean of the device's ratio, worst)}}}``, the device's from `model` applied
    to the pool's upstream sequence on sim, the labels as :func:`_label` gives them."""
    import math

    from mempool.tools import corpus

    rows = []
    for entry in corpus.load_manifest(directory):
        if not entry.recorded:
            continue
        cells = {}
        for rounding in settings:
            seq, info = sequence(entry.path, rounding)
            live = info["peak_live"]
            cells[_label(rounding)] = (info["peak_reserved"] / live,
                                       peak_held(seq, **CANDIDATES[model]) / live,
                                       info["num_device_alloc"])
        rows.append({"name": entry["name"], "half": entry["half"], "cells": cells})
    summary = {}
    for half in corpus.HALVES:
        mine = [r for r in rows if r["half"] == half]
        summary[half] = {}
        for rounding in settings:
            devs = [r["cells"][_label(rounding)][1] for r in mine]
            summary[half][_label(rounding)] = (
                (math.exp(sum(map(math.log, devs)) / len(devs)), max(devs)) if devs else None)
    return {"rows": rows, "summary": summary, "model": model}


def corpus_table(directory=None, settings=(None, "32MiB"), model=FITTING[0]):
    """:func:`corpus_figures` as a table: a line per trace, the tuning half first, then each
    half's geometric mean and worst of the device's ratio, side by side."""
    fig = corpus_figures(directory, settings, model)
    labels = [_label(r) for r in settings]
    lines = ["| half | trace | " + " | ".join(f"{lb}: pool / device (segment allocs)"
                                               for lb in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    from mempool.tools.corpus import HALVES
    for half in HALVES:
        for r in (r for r in fig["rows"] if r["half"] == half):
            lines.append(f"| {half} | {r['name']} | " + " | ".join(
                "{:.3f} / {:.3f} ({})".format(*r["cells"][lb]) for lb in labels) + " |")
    for half in HALVES:
        lines.append(f"| {half} | device: geomean, worst | " + " | ".join(
            "-" if fig["summary"][half][lb] is None else
            "{:.3f}, {:.3f}".format(*fig["summary"][half][lb]) for lb in labels) + " |")
    return "\n".join(lines + ["", f"device: {model}, {CHUNK // MiB} MiB chunks"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequence", default=None,
                    help="print the upstream sequence of TRACE:ROUNDING (e.g. vision_train:plain)")
    ap.add_argument("--predict", action="store_true",
                    help="this build's segments under the fitting models (and first fit), "
                         "for several segment_rounding values")
    ap.add_argument("--trace", action="append", default=None, metavar="PATH",
                    help="with --predict: a trace to use instead of the shipped ones (any "
                         "format `python -m mempool replay` reads; repeatable)")
    ap.add_argument("--kept", action="store_true",
                    help="with --predict: the device when the segments released before a "
                         "growth are freed behind work still running and nothing "
                         "synchronizes their stream (the pool before Note [Released before "
                         "a growth])")
    ap.add_argument("--corpus", nargs="?", const="", default=None, metavar="DIR",
                    help="each trace of a corpus (default: the shipped one) with plain and "
                         "32 MiB segments: the pool's peak and the device's under the first "
                         "fitting model, over peak live, each half's summary")
    args = ap.parse_args(argv)
    if args.corpus is not None:
        print(corpus_table(args.corpus or None))
        return 0
    if args.sequence:
        name, _, rounding = args.sequence.partition(":")
        rounding = None if rounding in ("", "plain", "2MiB") else rounding
        seq, info = sequence(name, rounding)
        for (op, seg, n, s), ev in zip(seq, info["event_of"]):
            print(f"{ev:>6} {op:<5} seg {seg:>4} {n / MiB:>7g} MiB stream {s}")
        return 0
    if args.predict:
        print(predictions_table(traces=tuple(args.trace) if args.trace else TRACES,
                                kept=args.kept))
        return 0
    print(candidates_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
