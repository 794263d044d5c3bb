"""Cells of ``replay --corpus`` in child processes: one process per replay, pinned to one
CPU, the columns' processes in rounds.

A published time is the median over several processes, each pinned to one CPU and
interleaved, with the worst stated. A replay's ns per event depends on the process it runs
in (where its heap and the pool's tables landed, which core it ran on, what the host was
doing those seconds), so one process's figure is one draw; ``--processes N`` runs each
(trace, column) cell N times, each time in a fresh process, and reports the median and the
slowest. The columns' processes take turns (:func:`schedule`): round r runs every column's
r-th process before any column's (r+1)-th, so a host that slows down over minutes slows
every column alike instead of whichever happened to run then.

:func:`run_cell` is the one way a cell runs in a child: the corpus's columns under
``--processes``, and PyTorch's columns and ``--compare`` rows always (PyTorch reads its
``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts, so each of its settings needs a process
of its own). The child is this module run as ``python -m mempool.tools.corpus_processes``:
it reads the cell from its stdin, pins itself, replays and prints the cell as one JSON line.
"""
from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import time

__all__ = ["MAX_PROCESSES", "MEMORY_KEYS", "processes_error", "schedule", "pick_cpu",
           "pool_cell", "torch_cell", "driver_pool_cell", "run_cell", "combine", "run_rounds",
           "parse_processes"]

# More than this many processes per cell buys a median nothing and multiplies the run time
# by the same factor (a cuda corpus starts a PyTorch per process).
MAX_PROCESSES = 64
# What a cell's processes must agree on: the replay is the same, only its time is the
# process's. (The ratio follows from the peak, and may be NaN for an empty trace.)
MEMORY_KEYS = ("peak_reserved_bytes", "num_ooms")
# A child that runs this long has hung (a whole corpus trace replays in seconds).
CHILD_TIMEOUT_S = 1800
# Keys of a child's answer that are about its process, not its cell.
_PROCESS_KEYS = ("pinned", "cpu", "pin_error")


ACCEPTED = f"a whole number from 1 to {MAX_PROCESSES} (processes per cell)"


def processes_error(value) -> str | None:
    """Why `value` is not a number of processes per cell (a line without the option's name),
    or None when it is one: an int from 1 to :data:`MAX_PROCESSES`."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected {ACCEPTED}; got {value!r}"
    if value < 1:
        return f"expected {ACCEPTED}; got {value}: each cell needs at least one process"
    if value > MAX_PROCESSES:
        return (f"expected {ACCEPTED}; got {value}: a median needs no more, and each "
                "process is a replay of its own")
    return None


def parse_processes(text: str) -> int:
    """The number of processes per cell that `text` (an option's value) says; ValueError
    with :func:`processes_error`'s line where it says none."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"expected {ACCEPTED}; got {text!r}") from None
    error = processes_error(value)
    if error:
        raise ValueError(error)
    return value


def schedule(columns, n: int) -> list:
    """The order in which the processes of one trace's cells run: ``(round, column)`` pairs,
    round 0 of every column (in `columns`' order), then round 1 of every column, ... up to
    round n - 1."""
    return [(r, c) for r in range(n) for c in columns]


def cpu_paces(loops: int = 200_000, probes: int = 3) -> dict:
    """ns per iteration of an empty Python loop on each CPU this process may use (the median
    of `probes`), measured by moving this process there: the hosts these runs use have had
    cores of two speeds, and a process's time follows its core's."""
    home = os.sched_getaffinity(0)
    paces = {}
    try:
        for cpu in sorted(home):
            os.sched_setaffinity(0, {cpu})
            runs = []
            for _ in range(probes):
                t0 = time.perf_counter_ns()
                for _ in range(loops):
                    pass
                runs.append((time.perf_counter_ns() - t0) / loops)
            paces[cpu] = statistics.median(runs)
    finally:
        os.sched_setaffinity(0, home)
    return paces


def pick_cpu() -> tuple:
    """``(cpu, None)``: the CPU a round's processes are pinned to, the one of this process's
    set with the fastest pace now (the cores of one host can run at different paces, and a
    round's processes are compared with each other); or ``(None, note)`` where no process
    can be pinned, the note saying why."""
    if not (hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")):
        return None, ("not pinned: this platform has no os.sched_setaffinity; each process "
                      "ran where the scheduler put it")
    try:
        paces = cpu_paces()
    except OSError as e:
        return None, f"not pinned: os.sched_setaffinity failed here ({e})"
    return min(paces, key=paces.get), None


# ------------------------------------------------------------------------------------------
# cells: what a child replays

def pool_cell(backend: str, limit=None, **options) -> dict:
    """A column of the pool: :func:`mempool.tools.replay.replay` of the trace with these
    arguments."""
    return {"kind": "pool", "backend": backend, "limit": limit, "options": options}


def torch_cell(torch_conf: str) -> dict:
    """A column of PyTorch's caching allocator under ``PYTORCH_CUDA_ALLOC_CONF`` =
    `torch_conf` ("" for its default)."""
    return {"kind": "torch", "torch_conf": torch_conf}


def driver_pool_cell(device: int = 0) -> dict:
    """The driver pool column: the trace straight on a fresh cudaMemPool of `device`."""
    return {"kind": "driver pool", "device": device}


def _child_env(cell) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if cell["kind"] == "torch" and cell["torch_conf"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = cell["torch_conf"]
    # The child imports this package from wherever this process did.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


def run_cell(cell: dict, path: str, cpu=None) -> dict:
    """Replay the trace at `path` as `cell` says (:func:`pool_cell`, :func:`torch_cell`,
    :func:`driver_pool_cell`) in a fresh process, pinned to `cpu` where it is not None.

    Returns the cell's figures (``ratio``, ``peak_reserved_bytes``, ``num_ooms``,
    ``ns_per_event`` and whatever else the column reports), or ``error``; with `cpu`, also
    ``pinned`` (whether the process ran on that CPU alone) and ``pin_error`` where it could
    not."""
    what = {"pool": "replay", "torch": "PyTorch replay",
            "driver pool": "driver pool replay"}[cell["kind"]]
    try:
        done = subprocess.run([sys.executable, "-m", __name__], env=_child_env(cell),
                              input=pickle.dumps({"cell": cell, "path": path, "cpu": cpu}),
                              capture_output=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the {what} ran over {CHILD_TIMEOUT_S // 60} minutes"}
    out = done.stdout.decode(errors="replace").strip().splitlines()
    err = done.stderr.decode(errors="replace").strip()
    try:
        return json.loads(out[-1])
    except (ValueError, IndexError):
        return {"error": (err or "\n".join(out))[-500:] or
                f"the {what} exited with status {done.returncode} and printed nothing"}


def combine(children: list) -> dict:
    """One cell from its processes' answers, in round order: the first process's figures,
    ``ns_per_event`` the median over the processes, ``ns_per_event_worst`` the slowest,
    ``ns_per_event_each`` every process's, ``n_processes``, ``children_agree`` (whether
    every process had the same :data:`MEMORY_KEYS`; where not, ``peak_reserved_bytes_each``
    too) and ``pinned`` (whether every process ran on its CPU alone). A process that failed
    makes the cell its error."""
    failed = [c for c in children if "error" in c]
    if failed:
        return {"error": failed[0]["error"] + (
            f" (in {len(failed)} of the {len(children)} processes run)" if len(children) > 1
            else "")}
    cell = {k: v for k, v in children[0].items() if k not in _PROCESS_KEYS}
    times = [c["ns_per_event"] for c in children]
    agree = all(all(c.get(k) == children[0].get(k) for k in MEMORY_KEYS) for c in children)
    cell.update(ns_per_event=statistics.median(times), ns_per_event_worst=max(times),
                ns_per_event_each=times, n_processes=len(children), children_agree=agree,
                pinned=all(c.get("pinned", False) for c in children))
    if not agree:
        cell["peak_reserved_bytes_each"] = [c.get("peak_reserved_bytes") for c in children]
    return cell


def run_rounds(runners: dict, n: int, pick=None) -> tuple:
    """Run one trace's cells, each in `n` processes, in :func:`schedule`'s order.

    `runners` maps each column's label to ``runner(cpu)``, which runs one process of its
    cell pinned to `cpu` (None: unpinned) and returns its answer (:func:`run_cell`'s).
    Each round's processes are pinned to the CPU ``pick()`` gives at the round's start
    (default :func:`pick_cpu`). Returns ``(cells, note)``: label -> :func:`combine` of its
    processes, and the note of a round whose processes could not be pinned (None when
    all could)."""
    pick = pick or pick_cpu
    answers = {label: [] for label in runners}
    cpu, note, at = None, None, None
    for r, label in schedule(list(runners), n):
        if r != at:
            cpu, why = pick()
            note, at = note or why, r
        if any("error" in a for a in answers[label]):
            continue          # a cell that failed once is its error; the others go on
        answers[label].append(runners[label](cpu))
    return {label: combine(got) for label, got in answers.items()}, note


# ------------------------------------------------------------------------------------------
# the child

def _pin(cpu) -> dict:
    if cpu is None:          # not asked to pin: the answer is the column's alone
        return {}
    try:
        os.sched_setaffinity(0, {cpu})
        return {"pinned": os.sched_getaffinity(0) == {cpu}, "cpu": cpu}
    except (AttributeError, OSError) as e:
        return {"pinned": False, "cpu": cpu, "pin_error": f"{type(e).__name__}: {e}"}


def _replay_here(cell: dict, path: str) -> dict:
    from mempool.tools import corpus
    from mempool.tools import replay as rp
    from mempool.tools import trace as mtrace

    if cell["kind"] == "torch":
        from mempool.tools import torch_replay

        return torch_replay.replay(path)
    prep = rp.prepare(mtrace.load_any(path))
    if cell["kind"] == "driver pool":
        return corpus.replay_on_driver_pool(prep, corpus.CudaDriverPool(cell["device"]))
    return corpus._mode_cell(rp.replay(prep, backend=cell["backend"], limit=cell["limit"],
                                       **cell["options"]))


def main() -> int:
    job = pickle.load(sys.stdin.buffer)
    # Before anything is imported or replayed: the whole process runs on its CPU.
    pinned = _pin(job["cpu"])
    try:
        row = _replay_here(job["cell"], job["path"])
    except Exception as e:  # noqa: BLE001 - the parent reports a failed cell and goes on
        row = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps({**row, **pinned}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
