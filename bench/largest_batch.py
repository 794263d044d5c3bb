"""The largest batch that fits under a fixed memory limit, allocator by allocator.

    python bench/largest_batch.py                                # sim, a 16 GiB limit
    python bench/largest_batch.py --limit 24GiB --out lb.json
    python bench/largest_batch.py --backend cuda --out lb.json   # a GPU: mempool and PyTorch

A fragmentation ratio says how much memory an allocator wastes; what a user of expandable
segments wants to know is how much larger a batch the same GPU then holds. For a fixed limit
this generates the transformer training trace of bench/make_traces.py (``transformer(batch=B)``,
the other parameters as shipped unless set: batch 16 is mempool/traces/transformer_train.jsonl.gz)
at one batch size after another, replays each through each allocator under the limit, and
reports the largest batch that replays with no OOM:

- mempool (default, expandable segments, ``roundup_power2_divisions:4``, ``max_split_size:64MB``)
  through ``mempool.tools.replay.replay(..., limit=LIMIT)``, the pool's cap on reserved bytes;
- with ``--backend cuda``, PyTorch's caching allocator by default and with
  ``expandable_segments:True``, each in a subprocess of its own (``PYTORCH_CUDA_ALLOC_CONF`` is
  read once, at CUDA initialisation), limited by
  ``torch.cuda.set_per_process_memory_fraction(LIMIT / total memory)`` and replayed through
  ``torch_replay`` of bench/fragmentation_gpu.py;
- and, as the bound no allocator can pass, the largest batch whose live bytes alone fit.

The search. Live bytes grow strictly with the batch, so the bound is exact: a galloping search
upwards from batch 1 over the traces alone (no replay). Each allocator's search then starts at
the bound (``--start`` moves it) and gallops down (1, 2, 4, ... below) until a batch fits, then
bisects between the highest fit and the lowest OOM. Fitting is not strictly monotone in the
batch (near its limit a pool can OOM at B and fit at B + 1: the sizes shift and a block that
did not fit a free hole now does), so the ``--check-above`` batches just above that boundary are
replayed as well, and the batch reported is the largest that fitted among all tried; the JSON
keeps every trial (batch, fits, OOMs, live, reserved).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import make_traces  # noqa: E402
from bench.provenance import commit  # noqa: E402
from mempool.tools import replay as rp  # noqa: E402
from mempool.bench.batch_search import (CHECK_ABOVE, MAX_BATCH, MEMPOOL_CONFS,  # noqa: E402
                                          _sim_options, live_bound, mempool_rows,
                                          mempool_trial, search)
from mempool._config import format_size, parse_size  # noqa: E402

GiB = 1 << 30
DEFAULT_LIMIT = "16GiB"
TORCH_CONFS = [
    ("torch default", ""),
    ("torch expandable_segments:True", "expandable_segments:True"),
]


# ---------------------------------------------------------------------------------------
# the workload


def model_params(**model) -> dict:
    """Every parameter of make_traces.transformer, the given ones over its defaults."""
    sig = inspect.signature(make_traces.transformer)
    params = {k: p.default for k, p in sig.parameters.items() if k != "batch"}
    unknown = set(model) - set(params)
    if unknown:
        raise ValueError(f"transformer() has no parameter {sorted(unknown)}")
    params.update(model)
    return params


class Traces:
    """The transformer trace at each batch size, generated and prepared once: the bound's
    search and every allocator's search try many of the same batches."""

    def __init__(self, **model):
        self.model = model_params(**model)
        self._prepared = {}

    def __call__(self, batch: int) -> rp.Prepared:
        prep = self._prepared.get(batch)
        if prep is None:
            prep = rp.prepare(make_traces.transformer(batch=batch, **self.model))
            self._prepared[batch] = prep
        return prep

    def describe(self) -> str:
        m = dict(self.model)
        lengths = m.pop("lengths")
        return (", ".join(f"{k} {v}" for k, v in m.items())
                + f", lengths {lengths[0]}..{lengths[1]}")


# ---------------------------------------------------------------------------------------
# PyTorch's rows (the search and mempool's rows: mempool/bench/batch_search.py)


def torch_trial(traces: Traces):
    """One batch replayed through PyTorch's caching allocator in this process (its conf and
    its memory fraction already set)."""
    from fragmentation_gpu import torch_replay

    def trial(batch):
        prep = traces(batch)
        t0 = time.perf_counter()
        r = torch_replay(prep)
        return {"batch": batch, "fits": r["num_ooms"] == 0, "num_ooms": r["num_ooms"],
                "needed_live_bytes": prep.peak_live_bytes,
                "peak_allocated_bytes": r["peak_allocated_bytes"],
                "peak_reserved_bytes": r["peak_reserved_bytes"],
                "seconds": round(time.perf_counter() - t0, 3)}

    return trial


def torch_worker(spec: dict) -> dict:
    """In a subprocess: PyTorch's search under the limit (the conf comes from the env)."""
    try:
        import torch
    except ImportError as e:
        return {"skipped": f"PyTorch is not installed ({e})"}
    if not torch.cuda.is_available():
        return {"skipped": f"PyTorch {torch.__version__} sees no CUDA device"}
    limit = spec["limit"]
    total = torch.cuda.get_device_properties(0).total_memory
    if limit > total:
        return {"skipped": f"the limit {format_size(limit)} exceeds the device's "
                           f"{total} bytes"}
    fraction = limit / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    traces = Traces(**spec["model"])
    found = search(torch_trial(traces), spec["start"], spec["max_batch"], spec["check_above"])
    return {"torch": torch.__version__, "device_name": torch.cuda.get_device_name(0),
            "total_memory": total, "memory_fraction": fraction,
            "expandable_segments_seen": _torch_segments_expandable(torch), **found}


def _torch_segments_expandable(torch):
    """Whether PyTorch's segments are expandable, from a snapshot of one allocation: proof
    that the conf took effect. None if the snapshot does not say."""
    try:
        p = torch.cuda.caching_allocator_alloc(32 << 20)
        try:
            seen = {s.get("is_expandable") for s in torch.cuda.memory._snapshot()["segments"]}
        finally:
            torch.cuda.caching_allocator_delete(p)
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - the check is a courtesy; the row stands without it
        return None
    return None if seen == {None} or not seen else all(seen)


def torch_rows(traces: Traces, limit: int, start: int, max_batch: int,
               check_above: int = CHECK_ABOVE, timeout: float = 120) -> list:
    spec = json.dumps({"limit": limit, "model": traces.model, "start": start,
                       "max_batch": max_batch, "check_above": check_above})
    rows = []
    for label, conf in TORCH_CONFS:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        env.pop("PYTORCH_ALLOC_CONF", None)      # the newer name, if set, could override it
        row = {"allocator": label, "conf": conf}
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker",
                                spec], env=env, capture_output=True, text=True,
                               timeout=timeout)
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired:
            row["error"] = f"the PyTorch subprocess ran past {timeout} s"
        except (ValueError, IndexError):
            row["error"] = (p.stderr or p.stdout)[-2000:]
        rows.append(row)
    return rows


def run(limit, backend: str = "sim", model: dict | None = None, start: int | None = None,
        max_batch: int = MAX_BATCH, check_above: int = CHECK_ABOVE, with_torch: bool = True,
        torch_timeout: float = 120, scan: bool = False, confs=MEMPOOL_CONFS) -> dict:
    """The whole measurement; what ``--out`` writes. `scan`: also replay every batch from 1
    to the bound + `check_above` afresh for each mempool row (its ``scan``), which checks the
    search against a linear scan and every recorded trial against a fresh replay."""
    limit = parse_size(limit, "limit")
    traces = Traces(**(model or {}))
    t0 = time.perf_counter()
    bound = live_bound(traces, limit, max_batch)
    first = start if start is not None else max(1, bound["largest"] or 1)
    rows = mempool_rows(traces, limit, backend, first, max_batch, check_above, confs)
    if scan:
        top = min((bound["largest"] or 0) + check_above, max_batch)
        for row in rows:
            if "trials" in row:
                trial = mempool_trial(traces, row["conf"], limit, backend,
                                      **_sim_options(backend, limit))
                row["scan"] = [trial(b) for b in range(1, top + 1)]
    if not with_torch:
        rows += [{"allocator": label, "conf": conf, "skipped": "not asked for (--no-torch)"}
                 for label, conf in TORCH_CONFS]
    elif backend != "cuda":
        rows += [{"allocator": label, "conf": conf,
                  "skipped": "PyTorch's allocator needs a GPU: run with --backend cuda"}
                 for label, conf in TORCH_CONFS]
    else:
        rows += torch_rows(traces, limit, first, max_batch, check_above, torch_timeout)
    return {"commit": commit(), "python": platform.python_version(), "backend": backend,
            "limit_bytes": limit, "trace": {"generator": "bench/make_traces.py transformer()",
                                            "params": traces.model},
            "search": {"start": first, "max_batch": max_batch, "check_above": check_above},
            "live_bound": bound, "rows": rows,
            "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------
# the report


def _trial(row: dict, batch):
    return next((t for t in row.get("trials", ()) if t["batch"] == batch), None)


def table(result: dict) -> str:
    limit = result["limit_bytes"]
    lines = [f"largest batch that fits in {format_size(limit)} ({result['backend']}): the "
             f"transformer trace of bench/make_traces.py at each batch, "
             f"{Traces(**result['trace']['params']).describe()}",
             f"{'allocator':<36} {'batch':>5} {'peak live GiB':>13} {'reserved GiB':>12} "
             f"{'reserved/limit':>14} {'trials':>6}"]
    bound = result["live_bound"]
    b = _trial(bound, bound["largest"])
    if b is None:
        lines.append(f"{'live bytes alone (the bound)':<36} not even batch 1 fits")
    else:
        lines.append(f"{'live bytes alone (the bound)':<36} {b['batch']:>5} "
                     f"{b['needed_live_bytes'] / GiB:>13.2f} {'':>12} {'':>14} "
                     f"{len(bound['trials']):>6}")
    notes = []
    for row in result["rows"]:
        name = row["allocator"]
        if "skipped" in row or "error" in row:
            why = row.get("skipped") or "error: " + row["error"].strip().splitlines()[-1][:120]
            lines.append(f"{name:<36} {why}")
            continue
        t = _trial(row, row["largest"])
        if t is None:
            lines.append(f"{name:<36} {'none':>5} {'':>13} {'':>12} {'':>14} "
                         f"{len(row['trials']):>6}")
            continue
        seen = row.get("expandable_segments_seen")
        if seen is not None and seen != ("expandable_segments:True" in row["conf"]):
            notes.append(f"{name}: PyTorch's segments were{'' if seen else ' not'} "
                         "expandable: the conf did not take effect as asked")
        mark = ""
        if row["largest"] != row["boundary"]:
            mark = "*"
            notes.append(f"* {name}: batch {row['largest']} fits although batch "
                         f"{row['boundary'] + 1} does not (not monotone)")
        lines.append(f"{name:<36} {str(t['batch']) + mark:>5} "
                     f"{t['needed_live_bytes'] / GiB:>13.2f} "
                     f"{t['peak_reserved_bytes'] / GiB:>12.2f} "
                     f"{t['peak_reserved_bytes'] / limit:>14.3f} {len(row['trials']):>6}")
    lines += notes
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default=DEFAULT_LIMIT,
                    help=f"the memory limit: bytes or a size such as 16GiB (default "
                         f"{DEFAULT_LIMIT})")
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim",
                    help="mempool's backend; cuda also runs the PyTorch rows (default sim)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps of the trace (default: make_traces' 14)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the sequence lengths (default: make_traces' 1)")
    ap.add_argument("--layers", type=int, default=None, help="default: make_traces' 12")
    ap.add_argument("--hidden", type=int, default=None, help="default: make_traces' 1024")
    ap.add_argument("--start", type=int, default=None,
                    help="the batch each allocator's search starts from (default: the bound)")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH,
                    help=f"the largest batch tried (default {MAX_BATCH})")
    ap.add_argument("--check-above", type=int, default=CHECK_ABOVE,
                    help=f"batches tried above each search's boundary (default {CHECK_ABOVE})")
    ap.add_argument("--model", metavar="JSON", default=None,
                    help="more transformer() parameters, as a JSON object: "
                         "'{\"heads\": 4, \"vocab\": 8000, \"lengths\": [64, 256]}'")
    ap.add_argument("--mempool", metavar="LABEL", action="append", default=None,
                    help="only this mempool row (repeatable): " +
                         ", ".join(repr(label) for label, _ in MEMPOOL_CONFS))
    ap.add_argument("--scan", action="store_true",
                    help="also replay every batch up to the bound afresh, per mempool row "
                         "(checks the search; slow on a large model)")
    ap.add_argument("--no-torch", action="store_true", help="leave out the PyTorch rows")
    ap.add_argument("--torch-timeout", type=float, default=120,
                    help="seconds each PyTorch subprocess may take (default 120)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--torch-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.torch_worker:
        try:
            out = torch_worker(json.loads(args.torch_worker))
        except Exception as e:  # noqa: BLE001 - the parent reports it as the row's error
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out))
        return 0
    model = {}
    if args.model:
        try:
            model = json.loads(args.model)
        except ValueError as e:
            ap.error(f"--model: not JSON ({e}); expected an object such as '{{\"heads\": 4}}'")
        if not isinstance(model, dict):
            ap.error(f"--model: expected a JSON object, got {type(model).__name__}")
        if isinstance(model.get("lengths"), list):
            model["lengths"] = tuple(model["lengths"])
    model.update({k: v for k, v in (("steps", args.steps), ("seed", args.seed),
                                    ("layers", args.layers), ("hidden", args.hidden))
                  if v is not None})
    confs = MEMPOOL_CONFS
    if args.mempool:
        known = dict(MEMPOOL_CONFS)
        unknown = [label for label in args.mempool if label not in known]
        if unknown:
            ap.error(f"--mempool: no row {unknown[0]!r}; the rows are "
                     + ", ".join(repr(label) for label in known))
        confs = [(label, known[label]) for label in args.mempool]
    try:
        model_params(**model)
    except (TypeError, ValueError) as e:
        ap.error(f"--model: {e}")
    result = run(args.limit, args.backend, model, args.start, args.max_batch,
                 args.check_above, not args.no_torch, args.torch_timeout, args.scan, confs)
    print(table(result))
    print(f"({result['seconds']} s)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
