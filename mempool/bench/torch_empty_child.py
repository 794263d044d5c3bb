"""Time ``torch.empty(n, dtype=uint8, device="cuda")`` + drop in a process of its own.

    python mempool/bench/torch_empty_child.py {caching,mempool} ROUNDS PAIRS SIZE [SIZE ...]
    python mempool/bench/torch_empty_child.py {caching,mempool} --lockstep PAIRS

PyTorch reads its allocator once, before the first CUDA allocation, so the pluggable
allocator (``mempool.torch.install``) and PyTorch's own caching allocator are each timed in
a fresh process; test_torch_empty.py runs both and puts them side by side. Prints one JSON
object: {size: {"ns_per_pair": median, "min_ns_per_pair": min}}, the median of ROUNDS
rounds of PAIRS pairs in a tight loop (after one warm-up round), as the rest of the suite.

With --lockstep the child times one round at a time when told to, so that a parent can
interleave the rounds of two children pinned to one CPU (bench/empty_pairs.py): it prints
READY once set up, then answers each line "ROUND SIZE" read from its standard input with
"NS <ns per pair>" (after WARM_PAIRS untimed pairs of that size, since the other child ran
on this CPU in between), and "END" with the JSON object above, without figures per size.
"""
import json
import os
import statistics
import sys
import time


COUNTERS = ("num_device_alloc", "num_device_free", "num_event_waits", "num_cross_stream_reuse",
            "num_sync_all_streams", "segment.all.allocated")


def cpu_jiffies():
    """(busy, total) jiffies of all CPUs from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def context():
    """What the machine looked like around the timing: a child slower inside the full suite
    than alone is either this process's doing (its counters, its threads) or the machine's
    (the other CPUs' load while it ran, the CPU it ran on, involuntary switches)."""
    import resource

    before, usage = cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
    t0, n = time.perf_counter_ns(), 2_000_000
    for _ in range(n):          # a fixed amount of interpreter work: the CPU's pace now
        pass
    elapsed = time.perf_counter_ns() - t0
    after, usage_after = cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
    busy = None
    if before and after and after[1] > before[1]:
        # CPUs busy on average over the loop, this one included (total jiffies / CPUs
        # = the loop's wall time in jiffies).
        ncpu = os.cpu_count() or 1
        busy = round((after[0] - before[0]) / ((after[1] - before[1]) / ncpu), 2)
    try:
        with open("/proc/self/stat") as f:
            on_cpu = int(f.read().rsplit(")", 1)[1].split()[36])
        threads = len(os.listdir("/proc/self/task"))
    except (OSError, IndexError, ValueError):
        on_cpu = threads = None
    return {"empty_loop_ns": elapsed / n, "cpus_busy": busy, "on_cpu": on_cpu,
            "threads": threads, "loadavg": os.getloadavg(),
            "cpus": len(os.sched_getaffinity(0)),
            "involuntary_switches": usage_after.ru_nivcsw - usage.ru_nivcsw,
            "trace": sys.gettrace() is not None or sys.getprofile() is not None}


WARM_PAIRS = 200


def set_up(allocator):
    """Import PyTorch and, for mempool, install a pool on device 0. Returns (torch, pool)."""
    import torch

    pool = None
    if allocator == "mempool":
        import mempool
        import mempool.torch

        pool = mempool.Pool(backend="cuda", device=0)
        mempool.torch.install(pool)
    elif allocator != "caching":
        raise SystemExit(f"allocator must be 'caching' or 'mempool', got {allocator!r}")
    return torch, pool


def finish(torch, pool, out):
    """Add the pool's counters and the closing context to out, and print it."""
    torch.cuda.synchronize()
    if pool is not None:
        stats = pool.stats()
        assert stats["allocation.all.current"] == 0, "a tensor's block was not returned"
        out["pool_allocations"] = stats["allocation.all.allocated"]
        # Upstream traffic: a hot path that serves every pair leaves these at their
        # warm-up values, whatever the number of pairs.
        out["pool_counters"] = {key: stats[key] for key in COUNTERS}
    out["context"]["after"] = context()
    print(json.dumps(out), flush=True)


def lockstep(allocator, pairs):
    at_start = context()
    torch, pool = set_up(allocator)
    empty, uint8 = torch.empty, torch.uint8
    out = {"context": {"start": at_start, "before": context()}}
    print("READY", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words == ["END"]:
            break
        if len(words) != 2 or words[0] != "ROUND":
            raise SystemExit(f"lockstep: expected 'ROUND SIZE' or 'END', got {line!r}")
        nbytes = int(words[1])
        for _ in range(WARM_PAIRS):
            empty(nbytes, dtype=uint8, device="cuda")
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            empty(nbytes, dtype=uint8, device="cuda")
        print(f"NS {(time.perf_counter_ns() - t0) / pairs}", flush=True)
    finish(torch, pool, out)
    return 0


def main(argv):
    if len(argv) == 3 and argv[1] == "--lockstep":
        return lockstep(argv[0], int(argv[2]))
    allocator, rounds, pairs = argv[0], int(argv[1]), int(argv[2])
    sizes = [int(s) for s in argv[3:]]
    at_start = context()
    torch, pool = set_up(allocator)
    empty, uint8 = torch.empty, torch.uint8
    out = {"context": {"start": at_start, "before": context()}}
    for nbytes in sizes:
        # The CPU's pace just before this size's rounds: a core slowed for seconds shows here.
        t0, loops = time.perf_counter_ns(), 200_000
        for _ in range(loops):
            pass
        pace = (time.perf_counter_ns() - t0) / loops
        per_round = []
        for r in range(rounds + 1):
            t0 = time.perf_counter_ns()
            for _ in range(pairs):
                empty(nbytes, dtype=uint8, device="cuda")
            if r:                                   # round 0 warms up
                per_round.append((time.perf_counter_ns() - t0) / pairs)
        out[nbytes] = {"ns_per_pair": statistics.median(per_round),
                       "min_ns_per_pair": min(per_round), "empty_loop_ns": pace}
    finish(torch, pool, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
