"""The figures of one run of bench/gpu_run.sh as OUTDIR/<card>.json (bench/render_benchmarks.py
documents the schema), so that they can replace bench/results/<card>.json.

    python bench/collect_results.py OUTDIR [--card h100]

Reads what the run's stages wrote, each where present: versions.txt (date, commit, device),
junit-gpu-*.xml (the GPU tier), bench/bench.json (the latency suite), fragmentation_gpu.json
(trace replays), torch/workloads.json (torch.empty pairs, and the largest batch of each
model under a fixed cap, model by allocator), allocator_pairs.json (the
allocators timed from C++), numba-own/numba-own-tests.json (Numba's own tests) and
own-tests/*/own-tests.json (PyTorch's own tests, one table per pair of bench/torch_own_tests_pairs.py,
with the tests that passed under PyTorch's allocator only). A stage that did not run adds nothing. The median and worst are over processes (rounds where one process
ran them all, and then n_processes is 1).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batch_workloads  # noqa: E402  (this folder's; stdlib only at import)

SIZES = {"0": "0 B", "512": "512 B", "65536": "64 KiB", "1048576": "1 MiB",
         "67108864": "64 MiB"}
LATENCY_COLUMNS = ("512 B", "64 KiB", "1 MiB", "64 MiB")
TRACES = {"transformer_train.jsonl.gz": "transformer", "vision_train.jsonl.gz": "vision"}
JUNIT = {"junit-gpu-1.xml": "tests/gpu", "junit-gpu-1x.xml": "tests/gpu, gpu_exclusive",
         "junit-gpu-2.xml": "gpu-marked tests outside tests/gpu",
         "junit-gpu.xml": "gpu-marked tests (TESTS_ARGS)"}


def _fig(run, table, row, column, unit, values, command, n_processes=None):
    """One figure: the median and the largest (the worst, for times and ratios) of values,
    one per process. n_processes, where given, is for a value every process shares (a peak
    that each process reached alike): no spread is recorded then."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    spread = len(values) > 1 and n_processes is None
    return {"table": table, "row": row, "column": column, "unit": unit,
            "median": round(statistics.median(values), 3),
            "worst": round(max(values), 3) if spread else None,
            "n_processes": n_processes or len(values), "date": run["date"],
            "commit": run["commit"], "command": command}


def read_versions(outdir: str) -> dict:
    run = {"date": "unknown", "commit": "unknown", "card": "unknown GPU", "environment": ""}
    try:
        with open(os.path.join(outdir, "versions.txt"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return run
    env = []
    for line in lines:
        if line.startswith("date: "):
            run["date"] = line[6:16]
        elif line.startswith("commit: "):
            run["commit"] = line[8:].split()[0][:7]
        elif "," in line and run["card"] == "unknown GPU" and "NVIDIA" in line:
            run["card"] = line.split(",")[0].strip()
            env.append("driver " + line.split(",")[1].strip())
        elif re.match(r"^(Python|cupy|torch|jax|numpy) ", line):
            env.append(line.strip())
    run["environment"] = ", ".join(env)
    return run


def card_key(name: str) -> str:
    for key in ("h200", "h100", "a100", "l40", "b200"):
        if key in name.lower():
            return key
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def from_junit(run: dict, outdir: str) -> list:
    figs = []
    for name, label in JUNIT.items():
        path = os.path.join(outdir, name)
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            continue
        t = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
        for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            for key in t:
                t[key] += int(suite.get(key, 0))
        counts = {"passed": t["tests"] - t["failures"] - t["errors"] - t["skipped"],
                  "failed": t["failures"] + t["errors"], "skipped": t["skipped"]}
        for column, n in counts.items():
            figs.append(_fig(run, "GPU tier", label, column, "tests", [n],
                             "STAGES=tests bench/gpu_run.sh OUT"))
    return figs


def from_latency(run: dict, path: str) -> list:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    figs = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        if info.get("section") != "latency" or info.get("column") not in LATENCY_COLUMNS:
            continue
        if info.get("backend") in ("sim", "host"):
            continue
        figs.append(_fig(run, "Allocate + free from Python, one process", info["row"],
                         info["column"], "ns per pair", [info.get("ns_per_pair")],
                         "python -m mempool bench"))
    return figs


def from_fragmentation(run: dict, path: str) -> list:
    with open(path, encoding="utf-8") as f:
        rows = json.load(f).get("rows", [])
    figs = []
    for r in rows:
        trace = TRACES.get(r.get("trace"), r.get("trace"))
        runs = r.get("ns_per_event_runs") or [r.get("ns_per_event")]
        command = "python bench/fragmentation_gpu.py --out FILE"
        figs.append(_fig(run, "Trace replay: peak reserved / peak live, ns per event",
                         r["allocator"], f"{trace} reserved / live", "ratio",
                         [r.get("ratio")], command, n_processes=len(runs)))
        figs.append(_fig(run, "Trace replay: peak reserved / peak live, ns per event",
                         r["allocator"], f"{trace} ns per event", "ns per event", runs,
                         command))
    return figs


def _per_process(run, table, groups, command, rename=None):
    figs = []
    for key, procs in groups.items():
        if not isinstance(procs, list):
            continue
        for size, column in SIZES.items():
            values = [p[size]["ns_per_pair"] for p in procs
                      if isinstance(p.get(size), dict) and "ns_per_pair" in p[size]]
            figs.append(_fig(run, table, (rename or {}).get(key, key), column, "ns per pair",
                             values, command))
    return figs


def from_torch_empty(run: dict, path: str) -> list:
    with open(path, encoding="utf-8") as f:
        te = json.load(f).get("torch_empty") or {}
    table = "torch.empty + drop, processes side by side"
    command = "python bench/torch_workloads.py OUT --workloads empty --empty-control caching"
    groups = {k: te.get(k) for k in ("caching", "mempool")}
    figs = _per_process(run, table, groups, command,
                        {"caching": "PyTorch's caching allocator", "mempool": "mempool"})
    # Pair by pair: process i of each allocator ran side by side on one CPU.
    pairs = list(zip(te.get("caching") or [], te.get("mempool") or []))
    control = (te.get("control") or {}).get("caching") or []
    for size, column in SIZES.items():
        ratios = [m[size]["ns_per_pair"] / c[size]["ns_per_pair"] for c, m in pairs
                  if isinstance(c.get(size), dict) and isinstance(m.get(size), dict)]
        figs.append(_fig(run, table, "mempool / PyTorch, pair by pair", column, "ratio",
                         ratios, command))
        figs.append(_fig(run, table, "PyTorch / PyTorch (control), pair by pair", column,
                         "ratio", [c.get(size) for c in control], command))
    return figs


BATCH_TABLE = "Largest training batch under a fixed cap"
# The columns of the largest-batch table, in this order; any other allocator follows by name.
BATCH_ALLOCATORS = {"torch": "PyTorch", "torch-expandable": "PyTorch expandable_segments",
                    "mempool": "mempool", "mempool-expandable": "mempool expandable_segments"}


def from_largest_batches(run: dict, path: str) -> list:
    """The largest-batch workloads of bench/torch_workloads.py: one table per cap, a row per
    model and a column per allocator, each cell the largest batch of one process."""
    with open(path, encoding="utf-8") as f:
        rows = [r for r in json.load(f).get("rows", [])
                if r.get("workload") in batch_workloads.MODELS and "largest_batch" in r]
    figs = []
    for cap in sorted({r["cap_gib"] for r in rows}):
        table = f"{BATCH_TABLE}: {cap:g} GiB"
        command = ("python bench/torch_workloads.py OUT --workloads "
                   + ",".join(batch_workloads.WORKLOADS) + " --reps 1"
                   + (f" --batch-cap-gib {cap:g}" if cap != batch_workloads.DEFAULT_CAP_GIB
                      else ""))
        mine = [r for r in rows if r["cap_gib"] == cap]
        seen = {r["allocator"] for r in mine}
        order = [a for a in BATCH_ALLOCATORS if a in seen] + sorted(seen - set(BATCH_ALLOCATORS))
        for w in batch_workloads.WORKLOADS:
            for a in order:
                values = [r["largest_batch"] for r in mine
                          if r["workload"] == w and r["allocator"] == a]
                figs.append(_fig(run, table, batch_workloads.MODELS[w],
                                 BATCH_ALLOCATORS.get(a, a), "largest batch", values, command))
    return figs


def batch_notes(figs: list) -> dict:
    """The note under each largest-batch table: what a cell is, and the search's limit."""
    return {f["table"]: (
        "A cell is the largest batch whose training step ran with no out-of-memory error "
        "under the cap (torch.cuda.set_per_process_memory_fraction), found in one process by "
        "galloping up from batch 4 and bisecting (bench/batch_workloads.py); a cell of "
        f"{batch_workloads.MAX_BATCH:,} is the search's limit, so at least that.")
        for f in figs if f["table"].startswith(BATCH_TABLE)}


def from_allocator_pairs(run: dict, path: str) -> list:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    groups = {k: data.get(k) for k in ("caching", "mempool")}
    return _per_process(run, "Allocate + free timed from C++, behind PyTorch's interface",
                        groups, "python bench/torch_allocator_pairs.py --json FILE",
                        {"caching": "PyTorch's caching allocator", "mempool": "mempool"})


def from_numba_own(run: dict, path: str) -> list:
    with open(path, encoding="utf-8") as f:
        runs = json.load(f).get("runs", {})
    figs = []
    for key, label in (("numba", "under Numba's manager"), ("mempool", "under mempool")):
        tests = (runs.get(key) or {}).get("tests", {})
        for column in ("passed", "failed", "skipped"):
            n = sum(1 for status in tests.values() if status[0] == column)
            figs.append(_fig(run, "Numba's own cudadrv tests", label, column, "tests", [n],
                             "python bench/numba_own_tests.py OUT"))
    return figs


OWN_TESTS_ROWS = (("pytorch", "under PyTorch's allocator"), ("mempool", "under mempool"))
# A list entry keeps the first line of a test's message, cut here.
MESSAGE_CHARS = 200


def own_tests_files(outdir: str) -> list:
    """[(pair name, path)] of the own-tests.json files a run wrote: one per pair, in the order
    own-tests-pairs.json ran them, or a single one directly in own-tests/."""
    folder = os.path.join(outdir, "own-tests")
    order = []
    try:
        with open(os.path.join(folder, "own-tests-pairs.json"), encoding="utf-8") as f:
            order = [p["name"] for p in json.load(f).get("pairs", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    found = {os.path.basename(os.path.dirname(p)): p
             for p in glob.glob(os.path.join(folder, "*", "own-tests.json"))}
    names = [n for n in order if n in found] + sorted(n for n in found if n not in order)
    files = [(n, found[n]) for n in names]
    single = os.path.join(folder, "own-tests.json")
    if os.path.isfile(single):
        files.insert(0, ("", single))
    return files


def from_own_tests(run: dict, name: str, path: str) -> tuple:
    """(figures, {table: test list}) of one pair: passed, failed and skipped under each
    allocator, and the tests that passed under PyTorch's allocator only, each with the first
    line of what it said under mempool."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    test_file, select = data.get("file", "test file"), data.get("select", "")
    table = f"PyTorch's own tests: {name or test_file}"
    command = (f"python bench/torch_own_tests.py {test_file} OUT"
               + (f" --select '{select}'" if select else ""))
    figs = []
    for key, label in OWN_TESTS_ROWS:
        counts = data["counts"][key]
        for column in ("passed", "failed", "skipped"):
            figs.append(_fig(run, table, label, column, "tests", [counts[column]], command))
    only = data.get("passed_under_pytorch_only") or {}
    items = [[t, " ".join(str(why).split())[:MESSAGE_CHARS]] for t, why in sorted(only.items())]
    return figs, {table: {"title": "Passed under PyTorch's allocator, not under mempool",
                          "items": items}}


def from_before_after(run: dict, path: str) -> list:
    """bench/before_after.py: this build against an earlier one, process by process."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    raw, before = data["raw"], data.get("before_commit", "before")
    command = "python bench/before_after.py BEFORE_TREE AFTER_TREE --out FILE"
    tables = {"pair": "Allocate + free from Python (cuda pool), this build and the one before",
              "torch.empty": "torch.empty + drop under mempool.torch.install, this build and "
                             "the one before"}
    figs = []
    for measure, table in tables.items():
        for name, label in (("before", f"before ({before})"), ("after", "this build")):
            for size, values in (raw.get(measure, {}).get(name) or {}).items():
                figs.append(_fig(run, table, label, SIZES.get(str(size), str(size)),
                                 "ns per pair", values, command))
    return figs


CORPUS_RATIO_TABLE = "Trace corpus on the device: peak reserved / peak live"
CORPUS_TIME_TABLE = "Trace corpus on the device: ns per event"


def from_corpus(run: dict, path: str) -> list:
    """`python -m mempool replay --corpus --backend cuda [--processes N] --json`: every
    trace of the corpus under each column. The ratios are the same in every process; with
    --processes each cell's ns per event is the median of its processes, the worst stated
    (from one process it is one replay's, and no time is published)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    processes = data.get("processes") or 1
    if data.get("lanes"):   # bench/corpus_lanes.py
        command = (f"python bench/corpus_lanes.py FILE --lanes {len(data['lanes'])} "
                   f"--processes {processes}")
    else:
        command = ("python -m mempool replay --corpus --backend cuda"
                   + (f" --processes {processes}" if processes > 1 else "") + " --json")
    figs = []
    for row in data["rows"]:
        label = f"{row['name']} ({row['half']})"
        for column, cell in (row.get("cells") or {}).items():
            if not isinstance(cell, dict) or cell.get("ratio") is None:
                continue
            figs.append(_fig(run, CORPUS_RATIO_TABLE, label, column, "ratio",
                             [round(cell["ratio"], 4)], command,
                             n_processes=cell.get("n_processes")))
            each = cell.get("ns_per_event_each")
            if processes > 1 and each:
                figs.append(_fig(run, CORPUS_TIME_TABLE, label, column, "ns",
                                 [round(v, 1) for v in each], command))
    return figs


SOURCES = (("bench/bench.json", from_latency),
           ("fragmentation_gpu.json", from_fragmentation),
           ("torch/workloads.json", from_torch_empty),
           ("torch/workloads.json", from_largest_batches),
           ("allocator_pairs.json", from_allocator_pairs),
           ("numba-own/numba-own-tests.json", from_numba_own),
           ("before_after.json", from_before_after),
           ("corpus.json", from_corpus))


def collect(outdir: str) -> dict:
    run = read_versions(outdir)
    figs = from_junit(run, outdir)
    for rel, parse in SOURCES:
        path = os.path.join(outdir, rel)
        if os.path.exists(path):
            try:
                figs += parse(run, path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"{rel}: not read ({exc})", file=sys.stderr)
    lists = {}
    for name, path in own_tests_files(outdir):
        try:
            pair_figs, pair_lists = from_own_tests(run, name, path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"{os.path.relpath(path, outdir)}: not read ({exc})", file=sys.stderr)
            continue
        figs += pair_figs
        lists.update(pair_lists)
    figs = [f for f in figs if f is not None]
    out = {"card": run["card"], "environment": run["environment"], "figures": figs}
    if batch_notes(figs):
        out["notes"] = batch_notes(figs)
    if lists:
        out["test_lists"] = lists
    return out


def merge(path: str, run_data: dict) -> dict:
    """The card's file at `path` with every table this run measured replaced by the run's."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except FileNotFoundError:
        return run_data
    tables = {fig["table"] for fig in run_data["figures"]}
    kept = [fig for fig in old.get("figures", []) if fig["table"] not in tables]
    out = {"card": run_data["card"], "environment": run_data["environment"],
           "figures": kept + run_data["figures"]}
    for key in ("notes", "test_lists"):
        merged = {k: v for k, v in (old.get(key) or {}).items() if k not in tables}
        merged.update(run_data.get(key) or {})
        if merged:
            out[key] = merged
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", help="the folder bench/gpu_run.sh wrote")
    ap.add_argument("--card", help="the file's name, e.g. h100 (default: from the device name)")
    ap.add_argument("--into", metavar="JSON",
                    help="a card's results file: this run's tables replace the same tables "
                         "there, and its other tables stay, each with its own run")
    args = ap.parse_args(argv)
    data = collect(args.outdir)
    path = os.path.join(args.outdir, f"{args.card or card_key(data['card'])}.json")
    if args.into:
        data = merge(args.into, data)
        path = args.into
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(data['figures'])} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
