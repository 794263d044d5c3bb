"""bench/numba_own_tests.py: reading Numba's verbose unittest log and comparing the two
runs (no GPU, no Numba needed: the logs here are written as Numba's runner writes them)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import numba_own_tests as own  # noqa: E402

LOG = """\
test_a (pkg.test_m.TestM.test_a) ... ok
test_b (pkg.test_m.TestM.test_b) ... some output the test printed
ok
test_c (pkg.test_m.TestM.test_c) ... skipped 'Deallocation specific to Numba memory management'
test_d (pkg.test_m.TestM.test_d) (x=1) ... ok
test_d (pkg.test_m.TestM.test_d) (x=2) ... ERROR
test_e (pkg.test_m.TestM.test_e) ... FAIL
test_f (pkg.test_m.TestM.test_f) ... expected failure
test_gone (unittest.loader._FailedTest.test_gone) ... ERROR

======================================================================
ERROR: test_d (pkg.test_m.TestM.test_d) (x=2)
----------------------------------------------------------------------
Traceback (most recent call last):
  File "m.py", line 3, in test_d
    f()
AttributeError: 'CUdevice' object has no attribute 'id'

======================================================================
FAIL: test_e (pkg.test_m.TestM.test_e)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 0 != 2

======================================================================
ERROR: test_gone (unittest.loader._FailedTest.test_gone)
----------------------------------------------------------------------
ImportError: Failed to import test module: test_gone
Traceback (most recent call last):
ModuleNotFoundError: No module named 'filecheck'

----------------------------------------------------------------------
Ran 9 tests in 0.1s

FAILED (failures=1, errors=2, skipped=1)
"""


def test_each_tests_outcome_and_message_are_read_from_the_log():
    tests = own.parse_log(LOG)
    assert tests == {
        "pkg.test_m.TestM.test_a": ("passed", ""),
        "pkg.test_m.TestM.test_b": ("passed", ""),
        "pkg.test_m.TestM.test_c": ("skipped",
                                    "Deallocation specific to Numba memory management"),
        "pkg.test_m.TestM.test_d": ("failed",
                                    "AttributeError: 'CUdevice' object has no attribute 'id'"),
        "pkg.test_m.TestM.test_e": ("failed", "AssertionError: 0 != 2"),
        "pkg.test_m.TestM.test_f": ("passed", ""),
        "unittest.loader._FailedTest.test_gone": ("failed",
                                                  "ModuleNotFoundError: No module named "
                                                  "'filecheck'"),
    }


def test_only_the_tests_whose_outcome_differs_are_compared():
    a = {"t1": ("passed", ""), "t2": ("failed", "x"), "t3": ("passed", "")}
    b = {"t1": ("passed", ""), "t2": ("failed", "y"), "t3": ("skipped", "why"),
         "t4": ("passed", "")}
    assert own.compare({"numba": a, "mempool": b}) == [
        ("t3", ("passed", ""), ("skipped", "why")),
        ("t4", ("absent", ""), ("passed", "")),
    ]


def test_a_run_not_on_mempools_manager_fails_the_script(tmp_path, monkeypatch, capsys):
    def fake_run(name, suite, outdir, timeout):
        return {"manager": "NumbaCUDAMemoryManager", "probe_error": "", "status": 0,
                "ran": 2, "tests": {"t1": ("passed", "")}}

    monkeypatch.setattr(own, "run", fake_run)
    assert own.main([str(tmp_path)]) == 1
    assert "the run under mempool had manager 'NumbaCUDAMemoryManager'" in \
        capsys.readouterr().err
    assert (tmp_path / "numba-own-tests.json").exists()


def test_the_differences_are_printed_and_a_run_with_no_test_fails(tmp_path, monkeypatch,
                                                                    capsys):
    def fake_run(name, suite, outdir, timeout):
        if name == "numba":
            return {"manager": "NumbaCUDAMemoryManager", "probe_error": "", "status": 0,
                    "ran": 1, "tests": {"t1": ("passed", "")}}
        return {"manager": "MempoolNumbaManager", "probe_error": "", "status": 1,
                "ran": 1, "tests": {"t1": ("failed", "boom")}}

    monkeypatch.setattr(own, "run", fake_run)
    assert own.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 tests differ" in out
    assert "t1: under Numba's manager passed; under mempool's failed: boom" in out

    def no_tests(name, suite, outdir, timeout):
        return {"manager": "MempoolNumbaManager", "probe_error": "", "status": 1, "ran": 0,
                "tests": {}}

    monkeypatch.setattr(own, "run", no_tests)
    assert own.main([str(tmp_path)]) == 1
    assert "no test ran under numba, mempool" in capsys.readouterr().err
