"""What the GPU tests of sharing across processes share (tests/gpu/test_gpu_ipc.py,
tests/gpu/test_gpu_torch_ipc.py): scripts run as files (spawn and forkserver import the
main module again in the child, which a ``python -c`` script does not have), and whether
this machine lets a child take its parent's descriptors.

A consumer takes the producer's descriptors with pidfd_getfd, which needs ptrace permission
over the producer (Note [Sharing CUDA memory], mempool/_csrc/upstream/mp_cuda_share.c): with
Yama's ptrace_scope at 1 a process may take its descendants' only, so a child opening what
its parent shared is refused, with a message naming the setting.
"""
import os
import subprocess
import sys
import textwrap

YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def child_may_open_parents():
    """Whether a child may take its parent's descriptors here (no Yama, or scope 0)."""
    try:
        with open(YAMA) as f:
            return f.read().strip() == "0"
    except OSError:
        return True


def run_script(tmp_path, source, *args, timeout=300):
    """Run `source` as a file with `args`; its stdout (the run must succeed)."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, cwd=str(tmp_path), env=env)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout
