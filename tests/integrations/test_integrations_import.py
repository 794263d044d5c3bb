"""Each integration imports its framework only when used, and says in one line what to
install when it is missing (checked in fresh interpreters, with the framework hidden)."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (integration, the framework's top-level modules, a first use, what the message asks for)
CASES = [
    ("mempool.numba", ("numba",), "m.MempoolNumbaManager", "pip install numba-cuda"),
    ("mempool.numba", ("numba",), "m.install()", "pip install numba-cuda"),
    ("mempool.dask", ("distributed", "dask"), "m.MempoolPlugin", "pip install distributed"),
    ("mempool.dask", ("distributed", "dask"), "m.report(None)", "pip install distributed"),
    ("mempool.prometheus", ("prometheus_client",), "m.serve(0)",
     "pip install prometheus-client"),
    ("mempool.prometheus", ("prometheus_client",), "m.MempoolCollector()",
     "pip install prometheus-client"),
]


def run(code):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("module, frameworks", sorted({(c[0], c[1]) for c in CASES}))
def test_importing_the_integration_imports_no_framework(module, frameworks):
    out = run(f"""
        import importlib, sys
        importlib.import_module({module!r})
        print(sorted(name for name in sys.modules if name.split(".")[0] in {frameworks!r}))
    """)
    assert out == "[]"


@pytest.mark.parametrize("module, frameworks, use, hint", CASES)
def test_a_missing_framework_says_what_to_install(module, frameworks, use, hint):
    out = run(f"""
        import importlib, sys
        for name in {frameworks!r}:
            sys.modules[name] = None          # as if it were not installed
        m = importlib.import_module({module!r})
        try:
            {use}
        except ImportError as exc:
            print(str(exc).splitlines()[0])
        else:
            print("no error")
    """)
    assert out.startswith(f"{module} needs ") and f"({hint})" in out.split(";")[0], out
