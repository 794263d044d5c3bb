"""Fragmentation on a real GPU: the shipped traces through mempool and the allocators users
would pick instead, side by side in one run.

    python bench/fragmentation_gpu.py [--out FILE.json] [--snapshot FILE.pickle]

For each trace in mempool/traces/ (transformer, vision) it replays every alloc and free,
allocating real device memory (no kernels), through:

- mempool ``backend="cuda"`` (default settings, and expandable segments where available,
  one physical allocation per growth; ``--pages`` and ``--max-map`` add rows with other
  page sizes and allocation sizes, ``--max-map page`` the one-allocation-per-page pool;
  ``--driver-rows`` adds the default path with the device synchronized at each step, as it
  was before 2026-12-03 (its cudaMemPool keeping every freed byte), and with plain segments
  (``segment_rounding`` 2 MiB) and 64 MiB ones, for the cudaMemPool's own peak);
- PyTorch's caching allocator (``torch.cuda.caching_allocator_alloc``/``_delete``) under
  several ``PYTORCH_CUDA_ALLOC_CONF`` settings, one subprocess each (the variable is read
  once, at CUDA initialisation);
- CuPy's ``MemoryPool`` (reserved bytes sampled after every allocation).

and reports peak reserved / peak live, ns per event (the median of ``--repeat`` processes per
row, 3 by default, run in rounds of one process per row), each row's time over the default
path's round by round, and the upstream calls per training step. With ``--snapshot`` it also
records a small PyTorch training loop with ``torch.cuda.memory._record_memory_history`` and
saves the snapshot pickle (no stack frames, to keep it small), the fixture for the
importer's tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mempool import _cuda as mcuda  # noqa: E402
from mempool.tools import replay as rp  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402
from mempool.tools.torch_replay import replay as torch_replay  # noqa: E402
from mempool.cli.trace import TRACES_DIR, calls_per_step_text  # noqa: E402

sys.path.insert(0, HERE)
from torch_workloads import fastest_cpus  # noqa: E402  (stdlib only at import)

TRACES = ("transformer_train.jsonl.gz", "vision_train.jsonl.gz")
TORCH_CONFS = ("", "expandable_segments:True", "roundup_power2_divisions:4",
               "max_split_size_mb:64")


def _trace_path(name):
    return name if os.path.exists(name) else os.path.join(TRACES_DIR, name)


def cupy_replay(path: str) -> dict:
    import cupy

    prep = rp.prepare(mtrace.load(path))
    pool = cupy.cuda.MemoryPool()
    bufs = [None] * prep.nslots
    peak = 0
    total = pool.total_bytes
    t0 = time.perf_counter_ns()
    for k, (a, b) in enumerate(rp.stretches(prep)):
        if k:
            pool.free_all_blocks()     # the program's empty_cache call, or trim to 0
        for slot, n, s in prep.ops[a:b]:
            if n:
                bufs[slot] = pool.malloc(n)
                r = total()
                if r > peak:
                    peak = r
            else:
                bufs[slot] = None
    elapsed = time.perf_counter_ns() - t0
    bufs = None
    pool.free_all_blocks()
    return {"peak_reserved_bytes": peak, "peak_live_bytes": prep.peak_live_bytes,
            "ns_per_event": elapsed / len(prep.ops), "ratio": peak / prep.peak_live_bytes,
            "note": "streams ignored; reserved sampled after each allocation",
            "trims_skipped": rp.partial_trims(prep)}     # CuPy has no trim to N bytes


def mempool_replay(path: str, conf: dict) -> dict:
    conf = dict(conf)
    sync_steps = conf.pop("sync_steps", False)
    if conf.pop("driver_keeps_all", False):
        # The default path as it was before Note [The driver keeps nothing given back]: a
        # cudaMemPool of its own that keeps every freed byte (the process ends with it).
        h, _ = mcuda.resolve_pool_handle("create", 0)
        mcuda.configure(h, release_threshold=mcuda.KEEP_ALL)
        conf["pool_handle"] = h
    r = rp.replay(mtrace.load(path), conf=conf, backend="cuda", check=True,
                  sync_steps=sync_steps)
    # calls_per_step: segment allocs and frees (expandable: map and unmap calls, each map one
    # physical allocation: Note [Growth extents]), stream syncs, event records and waits.
    return {"peak_reserved_bytes": r.peak_reserved_bytes,
            "peak_allocated_bytes": r.peak_allocated_bytes,
            "peak_live_bytes": r.peak_live_bytes, "num_ooms": r.num_ooms,
            "ns_per_event": r.ns_per_event, "ratio": r.ratio,
            "num_device_alloc": r.num_device_alloc, "num_device_free": r.num_device_free,
            "calls_per_step": r.calls_per_step,
            "syncs_per_step": [st["stream_syncs"] for st in r.steps] if r.steps else None,
            "driver_reserved_peak_bytes": r.driver_reserved_peak_bytes,
            "driver_used_peak_bytes": (r.stats or {}).get("cuda_pool.used_high"),
            "driver_ratio": (r.driver_reserved_peak_bytes / r.peak_live_bytes
                             if r.driver_reserved_peak_bytes is not None else None),
            "mapped_bytes": r.upstream["mapped_bytes"] if r.upstream else None}


def _calls(row) -> str:
    steps = row.get("calls_per_step")
    return f"  calls/step {calls_per_step_text(steps)}" if steps else ""


def record_torch_snapshot(path: str) -> dict:
    """A small training loop under PyTorch's memory history, saved as a snapshot pickle."""
    import pickle

    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    opt = torch.optim.Adam(model.parameters())
    torch.cuda.memory._record_memory_history(max_entries=100_000, context=None)
    for step in range(4):
        x = torch.randn(64 * (step + 1), 512, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    tr = mtrace.from_torch_snapshot(snap)
    r = rp.replay(tr)
    actions = {}
    for e in snap["device_traces"][0]:
        actions[e["action"]] = actions.get(e["action"], 0) + 1
    return {"file": path, "bytes": os.path.getsize(path), "trace_actions": actions,
            "entry_keys": sorted(snap["device_traces"][0][0]) if snap["device_traces"][0] else [],
            "segment_keys": sorted(snap["segments"][0]) if snap["segments"] else [],
            "block_keys": sorted(snap["segments"][0]["blocks"][0]) if snap["segments"] else [],
            "imported_events": len(tr), "imported_meta": tr.meta,
            "replayed_on_sim": {"peak_live_bytes": r.peak_live_bytes,
                                "peak_reserved_bytes": r.peak_reserved_bytes,
                                "unknown_frees": r.unknown_frees},
            "torch_reserved_peak": torch.cuda.memory_stats()["reserved_bytes.all.peak"]}


def _guard(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a failed row is reported, the run goes on
        return {"error": f"{type(e).__name__}: {e}"}


def _one_process(worker_args, env, cpu=None) -> dict:
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    p = subprocess.run([sys.executable, __file__, *worker_args], env=env,
                       capture_output=True, text=True, timeout=600, preexec_fn=pin)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (p.stderr or p.stdout)[-2000:]}


def _interleaved(repeat: int, rows) -> list:
    """Run each row's worker `repeat` times, one process each, in rounds: every row once,
    then every row again. The host's pace drifts over a run (the same default replay took
    482-810 ns per event within minutes, an earlier run (bench/results/ in git history)), so rows
    run one after another in turns, and each round's rows are compared with each other.
    Returns per row the first process's figures, ns_per_event the median over the rounds
    and ns_per_event_runs every round's, in round order."""
    runs = [[] for _ in rows]
    for _ in range(repeat):
        # A round's processes share one CPU, the fastest just before the round (as
        # torch_workloads.py's torch.empty children): cores of this host ran at two paces.
        (cpu,), _ = fastest_cpus(1)
        for i, (_, worker_args, env) in enumerate(rows):
            if runs[i] and "error" in runs[i][0]:
                continue
            got = _one_process(worker_args, env, cpu)
            if "error" in got:
                runs[i] = [got]
            else:
                runs[i].append(got)
    out = []
    for runs_of_row in runs:
        if "error" in runs_of_row[0]:
            out.append(runs_of_row[0])
            continue
        times = [r["ns_per_event"] for r in runs_of_row]
        ordered = sorted(times)
        out.append({**runs_of_row[0], "ns_per_event": ordered[len(ordered) // 2],
                    "ns_per_event_runs": times})
    return out


def round_ratios(row, base) -> list:
    """Row's ns per event over base's, round by round (the processes run next to each
    other)."""
    a, b = row.get("ns_per_event_runs") or [], base.get("ns_per_event_runs") or []
    return [x / y for x, y in zip(a, b) if y]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--snapshot", default=None, help="record a torch snapshot pickle here")
    ap.add_argument("--repeat", type=int, default=3,
                    help="processes per mempool and PyTorch row; ns/event is their median "
                         "(default 3)")
    ap.add_argument("--pages", default="",
                    help="also mempool expandable rows with these pages (the granularity "
                         "option), e.g. 8MiB,32MiB")
    ap.add_argument("--max-map", default="",
                    help="also mempool expandable rows with these max_map_size values (the "
                         "most bytes of one physical allocation), e.g. page,64MiB; 'page' = "
                         "one allocation per page, as before growth extents")
    ap.add_argument("--min-map", default="64MiB",
                    help="mempool expandable rows with these min_map_size values (the least "
                         "a growth at a range's end maps, Note [Edge growth]; default 64MiB; "
                         "'' for none)")
    ap.add_argument("--driver-rows", action="store_true",
                    help="also mempool default rows with the device synchronized at each "
                         "step, as before 2026-12-03 (its cudaMemPool keeping every freed "
                         "byte), and with plain segments (segment_rounding 2 MiB) and 64 MiB ones")
    ap.add_argument("--torch-confs", default=None,
                    help="PyTorch rows: PYTORCH_CUDA_ALLOC_CONF strings separated by ';' "
                         "('' = default; default: %s)" % ";".join(TORCH_CONFS))
    ap.add_argument("--torch-worker", nargs=1, metavar="TRACE", help=argparse.SUPPRESS)
    ap.add_argument("--mempool-worker", nargs=2, metavar=("TRACE", "CONF"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1; got {args.repeat}")
    if args.torch_worker:
        print(json.dumps(_guard(torch_replay, args.torch_worker[0])))
        return 0
    if args.mempool_worker:
        path, conf = args.mempool_worker
        print(json.dumps(_guard(mempool_replay, path, json.loads(conf))))
        return 0
    results = {"rows": []}
    mempool_rows = [("mempool default", {}),
                    ("mempool expandable_segments:True", {"expandable_segments": True})]
    for least in filter(None, args.min_map.split(",")):
        mempool_rows.append((f"mempool expandable, min_map_size {least}",
                             {"expandable_segments": True, "min_map_size": least}))
    if args.driver_rows:
        mempool_rows[1:1] = [("mempool default, synced steps", {"sync_steps": True}),
                             ("mempool default as before 2026-12-03",
                              {"driver_keeps_all": True}),
                             ("mempool, plain segments (segment_rounding 2 MiB)",
                              {"segment_rounding": "2MiB"}),
                             ("mempool default, 64 MiB segments",
                              {"segment_rounding": "64MiB"})]
    for page in filter(None, args.pages.split(",")):
        mempool_rows.append((f"mempool expandable, {page} pages",
                             {"expandable_segments": True, "granularity": page}))
    for most in filter(None, args.max_map.split(",")):
        # 1 byte rounds up to one page, whatever the page: one allocation per page
        mempool_rows.append((f"mempool expandable, max_map_size {most}",
                             {"expandable_segments": True,
                              "max_map_size": 1 if most == "page" else most}))
    torch_confs = TORCH_CONFS if args.torch_confs is None else args.torch_confs.split(";")
    for name in TRACES:
        path = _trace_path(name)
        rows = [(label, ["--mempool-worker", path, json.dumps(conf)], dict(os.environ))
                for label, conf in mempool_rows]
        rows += [(f"torch {conf or 'default'}", ["--torch-worker", path],
                  dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)) for conf in torch_confs]
        for (label, _, _), got in zip(rows, _interleaved(args.repeat, rows)):
            row = {"trace": name, "allocator": label, **got}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        row = {"trace": name, "allocator": "cupy MemoryPool", **_guard(cupy_replay, path)}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.snapshot:
        results["torch_snapshot"] = _guard(record_torch_snapshot, args.snapshot)
        print(json.dumps(results["torch_snapshot"], default=str), flush=True)
    print()
    for r in results["rows"]:
        if "error" in r:
            print(f"{r['trace']:<27} {r['allocator']:<40} error: {r['error'][:150]}")
        else:
            driver = (f"  (its cudaMemPool: {r['driver_ratio']:.3f})"
                      if r.get("driver_ratio") is not None else "")
            skipped = (f"  ({r['trims_skipped']} trims skipped: no trim to N bytes)"
                       if r.get("trims_skipped") else "")
            print(f"{r['trace']:<27} {r['allocator']:<40} reserved/live {r['ratio']:.3f}  "
                  f"{r['ns_per_event']:7.0f} ns/event{_calls(r)}{driver}{skipped}")
    # Each row's time against the default path's, from the processes of the same round.
    for name in TRACES:
        rows = [r for r in results["rows"] if r["trace"] == name and "error" not in r]
        base = next((r for r in rows if r["allocator"] == "mempool default"), None)
        for r in rows:
            ratios = round_ratios(r, base) if base and r is not base else []
            if ratios:
                r["ns_vs_default_by_round"] = ratios
                print(f"{name:<27} {r['allocator']:<40} ns/event over the default's, round "
                      f"by round: median {sorted(ratios)[len(ratios) // 2]:.2f}x, worst "
                      f"{max(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
