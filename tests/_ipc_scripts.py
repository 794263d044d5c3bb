"""What the GPU tests of sharing across processes share (tests/gpu/test_gpu_ipc.py,
tests/gpu/test_gpu_torch_ipc.py): scripts run as files (spawn and forkserver import the
main module again in the child, which a ``python -c`` script does not have).

A consumer takes the producer's descriptors with pidfd_getfd where it has ptrace permission
over the producer, and from the producer's descriptor server where it has not (Note [Passing
descriptors], mempool/_csrc/common/mp_fdpass.c): with Yama's ptrace_scope at 1 a child
opening what its parent shared goes through the server, so both directions open everywhere.
"""
import os
import subprocess
import sys
import textwrap

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
