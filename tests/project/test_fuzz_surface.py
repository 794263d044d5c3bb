"""The crash-seeking fuzzer of the public surface (tests/fuzz_surface_driver.py), in children.

Each target runs in a child process, so that a segfault or an abort is a failed test that
prints the seed, the batch and the last calls made, not a dead test run. Inside the child,
hypothesis drives every public function, method and property of Pool, Buffer, the devices,
``from_conf``, the option parsers and the mempool.torch / cupy / jax helpers with arbitrary
Python values, and checks after every call that the pool's invariants hold, that the
exception (if any) is a clear one, and that a refused call changed nothing.

Time: ``MEMPOOL_FUZZ_SECONDS`` (default 60) is shared by the targets; a release check runs
longer, e.g. ``MEMPOOL_FUZZ_SECONDS=3600 python -m pytest tests/project/test_fuzz_surface.py``.
Seed: random per run, printed on failure; ``MEMPOOL_FUZZ_SEED=N`` repeats a run. One failing
batch reproduces alone with the command the failure prints. Nothing asserted depends on the
machine's speed: a slow machine runs fewer batches in its time, and the check that every
public name is called runs a fixed number of batches of a fixed seed.
"""
import os
import random
import signal
import subprocess
import sys

import pytest

import mempool

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/
DRIVER = os.path.join(HERE, "fuzz_surface_driver.py")
# The checkout whose mempool this test imported: the children must fuzz the same build.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mempool.__file__)))
TARGETS = ["pool-sim", "pool-sim-expandable", "pool-host", "module", "inputs"]
# The coverage check runs a fixed amount of work under a fixed seed (the driver's sweep calls
# every name first), so that what it asserts depends on neither the machine's speed nor the
# seed.
COVERAGE_SEED, COVERAGE_BATCHES = 20240611, 1
TOTAL_SECONDS = float(os.environ.get("MEMPOOL_FUZZ_SECONDS", "60"))
SEED = int(os.environ.get("MEMPOOL_FUZZ_SEED", random.SystemRandom().randrange(1 << 31)))

pytest.importorskip("hypothesis")


def _signal_name(rc):
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _called_names(log_text):
    """The receiver.name or function labels the child called, from its log."""
    names = set()
    for line in log_text.splitlines():
        head = line.split("(", 1)[0].split(" = ", 1)[0]
        if head.startswith(("pool.", "device.", "buffer.", "mempool")):
            names.add(head)
    return names


# Seeds that once failed, run again every time (a batch each). 1532525617: with JAX
# installed, its first call kept an object later calls did not, and hypothesis refused the
# run when a draw's bounds followed the world's objects (fuzz_surface_driver.INDEX).
PINNED = [("pool-host", 1532525617)]


def _run_driver(target, seed, tmp_path, seconds=None, batches=None):
    """Run the driver in a child; return the calls it logged. Any failure says the seed
    and the command that reproduces it."""
    log = tmp_path / "calls.log"
    cmd = [sys.executable, DRIVER, "--target", target, "--seed", str(seed), "--log", str(log),
           "--tmpdir", str(tmp_path)]
    cmd += ["--batches", str(batches)] if batches else ["--seconds", f"{seconds:g}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    repro = (f"seed {seed}; reproduce with\n  cd {tmp_path} && PYTHONPATH={PACKAGE_ROOT} "
             f"python {DRIVER} --target {target} --seed {seed} --first-batch BATCH "
             f"--batches 1 --log calls.log\n(BATCH: the batch named above; "
             f"MEMPOOL_FUZZ_SEED={seed} repeats the whole run)")

    def fail(what, stdout="", stderr=""):
        calls = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        batches_run = [line for line in stdout.splitlines() if line.startswith("fuzz ")]
        pytest.fail(f"fuzz target {target}: {what}, seed {seed}, at "
                    f"{batches_run[-1] if batches_run else 'start'}\n"
                    "last calls (the last one was running):\n" + "\n".join(calls)
                    + f"\n{repro}\n--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n"
                    f"{stderr[-4000:]}", pytrace=False)

    # The limit only catches a hang: a batch's work is bounded, and the child stops starting
    # batches once its seconds are up, so a busy machine is slower, never a failure.
    limit = 1800 if batches else seconds * 10 + 600
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else exc.stdout or ""
        fail(f"hung (no end after {limit} s)", out)
    if proc.returncode != 0:
        fail(f"the child failed ({_signal_name(proc.returncode)})", proc.stdout, proc.stderr)
    if "done:" not in proc.stdout:
        fail("the child ended without finishing its batches", proc.stdout, proc.stderr)
    return log.read_text(errors="replace") if log.exists() else ""


@pytest.mark.parametrize("target,seed", [(t, SEED) for t in TARGETS] + PINNED,
                         ids=[*TARGETS, *(f"{t}-seed{s}" for t, s in PINNED)])
def test_fuzz_surface(target, seed, tmp_path):
    pinned = (target, seed) in PINNED
    seconds = 1.0 if pinned else max(1.0, TOTAL_SECONDS / len(TARGETS))
    _run_driver(target, seed, tmp_path, seconds=seconds)


@pytest.mark.slow
@pytest.mark.parametrize("target", [t for t in TARGETS if t != "inputs"])
def test_fuzz_reaches_every_name(target, tmp_path):
    # A name never called is surface the fuzzer lost track of (renamed, or no longer
    # reachable from its inventory). Fixed seed, fixed batches: the same calls every run.
    calls = _run_driver(target, COVERAGE_SEED, tmp_path, batches=COVERAGE_BATCHES)
    missed = _expected_names(target) - _called_names(calls)
    assert not missed, (f"never called in {COVERAGE_BATCHES} batches of seed "
                        f"{COVERAGE_SEED}: {sorted(missed)}")


def _expected_names(target):
    import fuzz_surface_driver as driver    # beside this file, as _support.py is
    if target == "module":
        return {label for label, _ in driver.module_functions()}
    pool = mempool.Pool(backend="sim" if target != "pool-host" else "host", capacity="64MB")
    names = set()
    for kind, obj in (("pool", pool), ("device", pool.device), ("buffer", pool.empty(1))):
        names |= {f"{kind}.{n}" for n in driver.public_names(type(obj))}
    return names
