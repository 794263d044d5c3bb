"""What several test files share: the simulated device's constants, readers of a pool's
layout and counters, GPU detection, and runners of child processes. Not a test file, and
imported by name (``from _support import ...``), as tests never import one another."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = 1 << 40   # the simulated device's first address
MiB = 1 << 20
GiB = 1 << 30


def gpu_available():
    try:
        from mempool import _cuda
        return _cuda.available()
    except Exception:
        return False


def blocks(pool):
    """[(offset from BASE, size, state)] of every block, in address order."""
    out = []
    for seg in pool.layout():
        for b in seg["blocks"]:
            out.append((b["address"] - BASE, b["size"], b["state"]))
    return out


def releasable_maps(pool, pinned=0):
    """The physical allocations of expandable segments that a release could unmap now: those
    wholly inside a run of free blocks (each goes only whole: Note [Growth extents]), past
    the first `pinned` bytes of a pinned segment (initial_pool_size)."""
    n = 0
    for seg in pool.layout():
        start = seg["address"] + (pinned if seg["is_pinned"] else 0)
        runs, run = [], None
        for b in seg["blocks"] + [{"state": None}]:
            if b["state"] == 0:
                run = [run[0] if run else b["address"], b["address"] + b["size"]]
                continue
            if run:
                runs.append(run)
            run = None
        n += sum(a >= start and any(lo <= a and a + size <= hi for lo, hi in runs)
                 for a, size in seg["maps"])
    return n


def run_threads(target, argsets):
    """Run target(*args) in one thread per argument tuple, started together, all joined."""
    import threading
    threads = [threading.Thread(target=target, args=tuple(args)) for args in argsets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def fetch_text(url, timeout=2, attempts=20):
    """GET `url` and return its body: a bounded retry loop, for a server thread that may
    still be starting (the metrics endpoints)."""
    import time
    import urllib.request
    last = None
    for _ in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.read().decode()
        except OSError as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"no answer from {url} after {attempts} attempts: {last}")


def stat_subset(pool, *keys):
    """{key: pool.stats()[key]} for the keys named."""
    stats = pool.stats()
    return {k: stats[k] for k in keys}


def device_counters(pool, *keys):
    """{key: the simulated device's counter} for the keys named."""
    counters = pool.device.counters()
    return {k: counters[k] for k in keys}


CONF_VARS = ("MEMPOOL_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "LOCAL_RANK")


def child(args, cwd, env=None, python=("-m", "mempool", "run"), timeout=300):
    """Run ``python [python...] args`` in a clean environment (no conf variables)."""
    base = {k: v for k, v in os.environ.items() if k not in CONF_VARS}
    base["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    base.update(env or {})
    return subprocess.run([sys.executable, *python, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=base)


# A sitecustomize that lets numba-cuda 0.x import on NumPy 2.5 (see its docstring): on the
# path of every child process that compiles a Numba kernel.
NUMPY_COMPAT = os.path.join(ROOT, "tests", "data", "numpy_compat")


def child_pythonpath(*first):
    """PYTHONPATH for a child process: ``first``, then this checkout, then the inherited path."""
    return os.pathsep.join([*first, ROOT, os.environ.get("PYTHONPATH", "")])


def run_example(name, *args, timeout=600, numba=False):
    """Run examples/<name> with this checkout first on the path and no MEMPOOL_CONF (an
    example reads its settings from its arguments); its stdout, after checking it succeeded.
    ``numba``: the example compiles Numba kernels (NUMPY_COMPAT goes on its path)."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath(*([NUMPY_COMPAT] if numba else [])))
    env.pop("MEMPOOL_CONF", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def run_mempool(*args, timeout=300):
    """``python -m mempool args`` from this checkout: the completed process."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mempool", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def check_tenant_caps(report, limit, chunk):
    """What examples/tenant_caps.py's report must show, on any backend."""
    greedy, steady = report["greedy"], report["steady"]
    # The tenant over its cap held exactly what the cap allows, then got the pool's error.
    assert greedy["limit"] == limit and greedy["held_at_oom"] == limit
    assert greedy["chunks"] == limit // chunk and greedy["num_ooms"] == 1
    from mempool._units import format_bytes
    assert f"refused by the pool's limit of {format_bytes(limit, exact=True)}" in greedy["oom"]
    # The other ran on, untouched: rounds after the OOM, its data intact, no OOM of its own.
    assert steady["rounds_after_peer_oom"] >= 5
    assert steady["bad_words"] == 0 and steady["num_ooms"] == 0
    assert chunk <= steady["peak_allocated"] <= limit
