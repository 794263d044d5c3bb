"""Per-tenant caps on one GPU: two processes, each pool with its own ``limit``.

    python examples/tenant_caps.py [--backend cuda|host] [--limit 2GiB] [--chunk 128MiB]

The recipe is one environment variable per process: ``MEMPOOL_CONF="limit:2GiB"`` (or a
fraction of the device, ``limit:0.25``) makes that process's ``mempool.default_pool()``
refuse to hold more than its cap, whatever the device has free. Two tenants run at once:

greedy
    allocates ``chunk`` after ``chunk`` until its pool refuses: it gets
    ``mempool.OutOfMemoryError`` naming its limit, having held exactly what the cap allows.
steady
    keeps a working set well under its own cap, writes and checks it round after round,
    and goes on for several rounds after the greedy tenant hit its cap: untouched by it.

The parent prints one JSON report. On a GPU the tenants share device 0 (``cuda``); without
one, ``--backend host`` runs the same recipe on host memory.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import gpu_available, require   # noqa: E402

if TYPE_CHECKING:
    from mempool import Pool

AFTER_PEER_OOM = 5          # rounds the steady tenant runs once the greedy one hit its cap
TIMEOUT_S = 60.0


def _wait_for(path: str, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def _signal(path: str) -> None:
    with open(path, "w"):
        pass


def _fill_and_check(pool: "Pool", nbytes: int, seed: int) -> int:
    """Write a pattern over a pool block and read it back; the number of wrong words."""
    if pool.backend == "cuda":
        import cupy
        import mempool.cupy as mc
        mc.set_allocator(pool)              # CuPy's temporaries count against the cap too
        arr = mc.from_pool(pool, (nbytes // 4,), "uint32")
        arr[:] = cupy.arange(arr.size, dtype=cupy.uint32) ^ seed
        bad = int((arr != (cupy.arange(arr.size, dtype=cupy.uint32) ^ seed)).sum())
        del arr
        return bad
    import numpy
    buf = pool.empty((nbytes // 4,), "uint32")
    arr = numpy.asarray(buf)
    arr[:] = numpy.arange(arr.size, dtype=numpy.uint32) ^ seed
    return int((arr != (numpy.arange(arr.size, dtype=numpy.uint32) ^ seed)).sum())


def greedy(chunk: int, folder: str) -> dict[str, Any]:
    import mempool
    pool = mempool.default_pool(0)          # MEMPOOL_CONF: this tenant's cap
    _wait_for(os.path.join(folder, "steady-ready"), "start from the steady tenant")
    held, message = [], None
    while message is None:
        try:
            held.append(pool.alloc(chunk))
        except mempool.OutOfMemoryError as exc:
            message = str(exc)
    out = {"limit": pool.options["limit"], "held_at_oom": pool.used_bytes(),
           "chunks": len(held), "oom": message, "num_ooms": pool.stats()["num_ooms"]}
    _signal(os.path.join(folder, "greedy-oom"))
    for ptr in held:
        pool.free(ptr)
    pool.check_invariants()
    return out


def steady(chunk: int, folder: str) -> dict[str, Any]:
    import mempool
    pool = mempool.default_pool(0)
    working_set = max(chunk, 4096)
    rounds = after = bad = 0
    _signal(os.path.join(folder, "steady-ready"))
    peer_oom = os.path.join(folder, "greedy-oom")
    deadline = time.monotonic() + TIMEOUT_S
    while after < AFTER_PEER_OOM:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the greedy tenant did not reach its cap in {TIMEOUT_S:.0f} s")
        seen = os.path.exists(peer_oom)
        bad += _fill_and_check(pool, working_set, rounds)
        rounds += 1
        after += seen
    pool.check_invariants()
    return {"limit": pool.options["limit"], "rounds": rounds, "rounds_after_peer_oom": after,
            "bad_words": bad, "num_ooms": pool.stats()["num_ooms"],
            "peak_allocated": pool.stats()["allocated_bytes.all.peak"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "host"),
                    default="cuda" if gpu_available() else "host")
    ap.add_argument("--limit", default="2GiB", help="each tenant's cap (MEMPOOL_CONF limit)")
    ap.add_argument("--chunk", default="128MiB", help="the greedy tenant's request size")
    ap.add_argument("--role", choices=("greedy", "steady"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from mempool import _config
    chunk = _config.parse_size(args.chunk, "chunk")
    if args.role:
        result = (greedy if args.role == "greedy" else steady)(chunk, args.folder)
        print(json.dumps(result))
        return 0
    if args.backend == "cuda" and not gpu_available():
        print("tenant_caps: --backend cuda needs a GPU (CuPy and a CUDA device); run with "
              "--backend host here")
        return 0
    if args.backend == "cuda":
        require("cupy", "CuPy (each tenant fills its blocks with it)", "cupy-cuda12x")
    conf = f"backend:{args.backend},limit:{args.limit}"
    if args.backend == "host":
        conf += ",capacity:8GiB"            # the host device's size, above both caps
    env = dict(os.environ, MEMPOOL_CONF=conf)
    with tempfile.TemporaryDirectory() as folder:
        procs = {role: subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                         "--role", role, "--chunk", args.chunk,
                                         "--folder", folder],
                                        env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                 for role in ("steady", "greedy")}
        report = {"conf": conf}
        for role, proc in procs.items():
            out, err = proc.communicate(timeout=TIMEOUT_S * 2)
            if proc.returncode != 0:
                print(f"tenant_caps: the {role} tenant failed:\n{out}{err}", file=sys.stderr)
                return 1
            report[role] = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
