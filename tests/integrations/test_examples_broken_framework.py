"""An example whose framework is installed but fails to import (a library missing under it, a
NumPy it does not support) says so in one line and exits 0, like one whose framework is not
installed; and the NumPy alias numba-cuda 0.x needs on NumPy 2.5 is put in place."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")

REQUIRE = """
import sys
sys.path[:0] = [{examples!r}, {fake!r}]
sys.argv = ["an_example.py"]
import _common
_common.require("fake_fw", "Fake FW", "fake-fw")
print("not reached")
"""


def run_require(tmp_path, init_source):
    fake = tmp_path / "site"
    (fake / "fake_fw").mkdir(parents=True)
    (fake / "fake_fw" / "__init__.py").write_text(init_source)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = REQUIRE.format(examples=EXAMPLES, fake=str(fake))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_framework_that_fails_to_import_is_one_line_not_a_traceback(tmp_path):
    out = run_require(tmp_path, "raise AttributeError(\"module 'numpy' has no attribute "
                                "'row_stack'\\nsecond line\")\n")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout.splitlines() == [
        "an_example.py: skipped, Fake FW is installed but `import fake_fw` fails here "
        "(AttributeError: module 'numpy' has no attribute 'row_stack')"]


def test_a_missing_dependency_of_an_installed_framework_is_not_called_not_installed(tmp_path):
    out = run_require(tmp_path, "import fake_fw_missing_dependency\n")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and "is installed but `import fake_fw` fails here" in lines[0]
    assert "fake_fw_missing_dependency" in lines[0] and "not installed" not in lines[0]


def test_an_absent_framework_names_what_to_install(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = REQUIRE.format(examples=EXAMPLES, fake=str(tmp_path)).replace("fake_fw", "no_such_fw")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "an_example.py: skipped, it needs Fake FW, which is not installed here "
        "(pip install fake-fw)"]


def test_numpy_names_for_numba_restores_row_stack():
    code = (f"import sys; sys.path.insert(0, {EXAMPLES!r})\n"
            "import numpy as np\n"
            "np.__dict__.pop('row_stack', None)\n"
            "assert not hasattr(np, 'row_stack')\n"
            "import _common\n"
            "_common.numpy_names_for_numba()\n"
            "print(np.row_stack is np.vstack)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "True"
