"""Which commit a result was measured on, for the JSON the benchmark scripts write."""
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def commit() -> str | None:
    """The checkout's HEAD; ``MEMPOOL_COMMIT`` when set (bench/gpu_run.sh: a tree copied
    to a GPU machine without its history names its commit so); None outside a checkout."""
    if os.environ.get("MEMPOOL_COMMIT"):
        return os.environ["MEMPOOL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
