"""torch.empty + drop under two allocators, timed in interleaved rounds on one CPU.

Each allocator needs a process of its own (PyTorch reads its allocator once), and a host's
pace differs from CPU to CPU and from minute to minute: on one H100 host an empty Python
loop took 12-29 ns per iteration from child to child, so children timed one after the other
compared the CPUs as much as the allocators (an earlier run (bench/results/ in git history): one
pair 0.37x, another 0.99x). Here the two children of a pair run at once, pinned to the same
CPU, and time one round at a time when told to (torch_empty_child.py --lockstep): rounds of
the two alternate A B B A A B ..., so both see the same CPU at nearly the same time, and each
child's figure is the median of its rounds.

    run_pair(children, cpu, sizes, rounds)  ->  {name: {"rounds": {size: [ns, ...]}, ...}}
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile


def start(argv, env, cpu):
    """A child with a pipe each way; its error output goes to a file (a pipe nobody reads
    while the rounds run could fill and stop it)."""
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=errors, text=True, env=env,
                            preexec_fn=pin)
    proc.error_file = errors
    return proc


def expect(proc, name, prefix):
    """The rest of the next line of proc's output that starts with prefix (other lines, such
    as a library's notices, are skipped). A child that ends first raises RuntimeError with
    the end of its error output."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    proc.wait()
    proc.error_file.seek(0)
    err = proc.error_file.read()[-3000:].decode(errors="replace")
    raise RuntimeError(f"{name} ended (exit status {proc.returncode}) before printing "
                       f"{prefix.strip()!r}: {err}")


def round_ratios(a, b):
    """Per round, b's ns over a's: the two rounds ran next to each other on one CPU."""
    return [y / x for x, y in zip(a, b)]


def round_shares(rounds, floor_rounds):
    """Per round, its ns less those of the floor round timed right after it."""
    return [x - f for x, f in zip(rounds, floor_rounds)]


def order(names, round_index):
    """A B, B A, A B, ...: neither child always goes first after the other's round."""
    return names if round_index % 2 == 0 else names[::-1]


def run_pair(children, cpu, sizes, rounds, env=None, floor=None):
    """children: {name: argv of a lockstep child}. Both start at once on `cpu` (None: not
    pinned); each size's rounds alternate between them. Returns {name: {"rounds": {size:
    [ns per pair of each round]}, "ns_per_pair": {size: median}, "result": the child's
    closing JSON line}}.

    With `floor` (a size, e.g. 0 B, for which the allocator returns at once), each round
    of every other size is followed at once by a round of `floor` in the same child, and
    the result also holds {"floor_rounds": {size: [...]}, "share_per_pair": {size: median
    of the rounds' differences}}: what the allocator adds to the call, each round against
    the floor timed next to it, so a host whose pace moves during the run (seconds on one
    CPU, then slower) moves both figures of a round alike."""
    names = list(children)
    procs = {}
    try:
        for name in names:
            procs[name] = start(children[name], env or dict(os.environ), cpu)
        for name in names:
            expect(procs[name], name, "READY")
        out = {name: {"rounds": {size: [] for size in sizes}} for name in names}
        floored = [size for size in sizes if floor is not None and size != floor]
        for name in names if floored else ():
            out[name]["floor_rounds"] = {size: [] for size in floored}

        def one_round(name, size):
            procs[name].stdin.write(f"ROUND {size}\n")
            procs[name].stdin.flush()
            return float(expect(procs[name], name, "NS "))

        for size in sizes:
            for r in range(rounds):
                for name in order(names, r):
                    out[name]["rounds"][size].append(one_round(name, size))
                    if size in floored:
                        out[name]["floor_rounds"][size].append(one_round(name, floor))
        for name in names:
            procs[name].stdin.write("END\n")
            procs[name].stdin.flush()
            out[name]["result"] = json.loads("{" + expect(procs[name], name, "{"))
            out[name]["ns_per_pair"] = {size: statistics.median(v)
                                        for size, v in out[name]["rounds"].items()}
            if floored:
                out[name]["share_per_pair"] = {
                    size: statistics.median(round_shares(out[name]["rounds"][size],
                                                         out[name]["floor_rounds"][size]))
                    for size in floored}
        return out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.error_file.close()
