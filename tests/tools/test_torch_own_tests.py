"""bench/torch_own_tests.py runs a test file twice, as it is and under `python -m mempool
run`, and names what differs (no GPU needed: a file of tests that tell the two runs apart
by whether the pool's launcher started them)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch_own_tests  # noqa: E402

TESTS = '''
import sys
import pytest

def launched_by_mempool():
    return "mempool.run" in sys.modules

def test_everywhere():
    assert 1 + 1 == 2

def test_only_without_the_pool():
    assert not launched_by_mempool(), "the pool's launcher ran this"

def test_only_with_the_pool():
    assert launched_by_mempool()

def test_skipped():
    pytest.skip("not here")

def test_failing_everywhere():
    assert False, "never"
'''


def run_both(tmp_path, capsys, source, name="test_sample.py"):
    """Write `source` as a test file, run the script on it: (OUTDIR, what it printed)."""
    test_file = tmp_path / name
    test_file.write_text(source)
    out = tmp_path / "out"
    assert torch_own_tests.main([str(test_file), str(out), "--timeout", "120"]) == 0
    return out, capsys.readouterr().out


@pytest.mark.slow
def test_the_two_runs_and_what_differs(tmp_path, capsys):
    out, printed = run_both(tmp_path, capsys, TESTS)
    assert "pytorch: 2 passed, 2 failed, 1 skipped" in printed
    assert "mempool: 2 passed, 2 failed, 1 skipped" in printed
    assert ("passed under PyTorch's allocator, not under mempool: 1\n"
            "  test_sample::test_only_without_the_pool: failed: AssertionError: the pool's "
            "launcher ran this") in printed
    assert ("passed under mempool, not under PyTorch's allocator: 1\n"
            "  test_sample::test_only_with_the_pool") in printed
    assert os.path.isfile(out / "own-tests.json")


def test_a_missing_file_is_named(tmp_path, capsys):
    try:
        torch_own_tests.main([str(tmp_path / "nope.py"), str(tmp_path)])
    except SystemExit as e:
        assert e.code == 2
    assert "test_file: no file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_without_its_junit_file_is_read_from_its_log(tmp_path):
    """A run cut at its limit (or crashed) writes no JUnit file: the -v log gives the same
    outcomes under the same names."""
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(TESTS + "\n\nclass TestGroup:\n    def test_in_a_class(self):\n"
                         "        pass\n")
    out = tmp_path / "out"
    torch_own_tests.main([str(test_file), str(out), "--timeout", "120"])
    from_junit = torch_own_tests.outcomes(str(out / "own-tests-pytorch.junit.xml"))
    from_log = torch_own_tests.outcomes_from_log(str(out / "own-tests-pytorch.log"))
    assert "test_sample.TestGroup::test_in_a_class" in from_log
    assert {t: o for t, (o, _) in from_junit.items()} == {t: o for t, (o, _) in from_log.items()}


# A test file newer than its package: it imports names the installed package lacks.
NEWER_TESTS = '''
from fakepkg.testing import (
    present, TEST_CUDAMALLOCASYNC, TEST_NEW_THING, IS_NEW_HARDWARE, MI999_ARCH,
    skipIfNewHardwareArch, tf32_on_and_off, new_helper,
)

def test_flags_say_the_feature_is_absent():
    assert present == 1
    assert TEST_NEW_THING is False and IS_NEW_HARDWARE is False and MI999_ARCH is None
    assert TEST_CUDAMALLOCASYNC is False   # PyTorch is not on the driver's allocator here

@skipIfNewHardwareArch(MI999_ARCH)
def test_a_skip_decorator_lets_the_test_run():
    pass

@tf32_on_and_off(0.01)
def test_a_precision_switch_lets_the_test_run():
    pass

def test_a_missing_helper_fails_by_name():
    new_helper()
'''


def fake_package(root):
    (root / "fakepkg").mkdir()
    (root / "fakepkg" / "__init__.py").write_text("")
    (root / "fakepkg" / "testing.py").write_text("present = 1\n")


@pytest.mark.slow
def test_names_a_newer_file_imports_get_the_same_stand_ins_in_both_runs(tmp_path, capsys,
                                                                         monkeypatch):
    fake_package(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("OWN_TESTS_COMPAT_PACKAGES", "fakepkg")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_newer.py").write_text(NEWER_TESTS)
    out = tmp_path / "out"
    assert torch_own_tests.main([str(tests / "test_newer.py"), str(out), "--timeout", "120"]) == 0
    printed = capsys.readouterr().out
    assert "pytorch: 3 passed, 1 failed, 0 skipped" in printed, printed
    assert "mempool: 3 passed, 1 failed, 0 skipped" in printed, printed
    assert "passed under PyTorch's allocator, not under mempool: 0" in printed
    assert ("not in this PyTorch, in both runs: fakepkg.testing.skipIfNewHardwareArch: "
            "decorator that changes nothing") in printed
    result = json.loads((out / "own-tests.json").read_text())
    for name in ("pytorch", "mempool"):
        outcome, message = result["runs"][name]["tests"][
            "test_newer::test_a_missing_helper_fails_by_name"]
        assert outcome == "failed" and "fakepkg.testing.new_helper is not in the installed" \
            in message, message
        filled = {e["name"]: e["stand_in"]
                  for e in next(iter(result["runs"][name]["stand_ins"].values()))}
        assert filled == {
            "TEST_CUDAMALLOCASYNC": "flag, False on this machine",
            "TEST_NEW_THING": "flag, False (a feature the release lacks)",
            "IS_NEW_HARDWARE": "flag, False (a feature the release lacks)",
            "MI999_ARCH": "constant, None",
            "skipIfNewHardwareArch": "decorator that changes nothing",
            "tf32_on_and_off": "decorator that changes nothing",
            "new_helper": "raises NotImplementedError when called"}


@pytest.mark.slow
def test_a_file_that_does_not_collect_is_a_failed_run(tmp_path, capsys, monkeypatch):
    """Without stand-ins (its package not named), the file stops at collection under both
    allocators: no test ran, and the script says so and exits 1 instead of reporting two
    equal runs."""
    fake_package(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("OWN_TESTS_COMPAT_PACKAGES", "somethingelse")
    (tmp_path / "test_newer.py").write_text(NEWER_TESTS)
    out = tmp_path / "out"
    assert torch_own_tests.main([str(tmp_path / "test_newer.py"), str(out),
                                 "--timeout", "120"]) == 1
    printed = capsys.readouterr().out
    assert "pytorch: the file's tests were not collected (see own-tests-pytorch.log)" in printed
    assert "mempool: the file's tests were not collected (see own-tests-mempool.log)" in printed


@pytest.mark.slow
def test_a_baseline_stands_for_the_run_under_pytorchs_allocator(tmp_path, capsys):
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(TESTS)
    first = tmp_path / "first"
    assert torch_own_tests.main([str(test_file), str(first), "--timeout", "120"]) == 0
    capsys.readouterr()
    again = tmp_path / "again"
    assert torch_own_tests.main([str(test_file), str(again), "--timeout", "120",
                                 "--baseline", str(first / "own-tests.json")]) == 0
    printed = capsys.readouterr().out
    assert f"(exit status 1, from {first / 'own-tests.json'})" in printed, printed
    assert not (again / "own-tests-pytorch.log").exists()     # not run again
    assert (again / "own-tests-mempool.log").exists()
    assert ("passed under PyTorch's allocator, not under mempool: 1\n"
            "  test_sample::test_only_without_the_pool") in printed


def test_a_baseline_that_is_not_an_own_tests_file_is_refused(tmp_path, capsys):
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(TESTS)
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": {}}')
    try:
        torch_own_tests.main([str(test_file), str(tmp_path / "out"), "--baseline", str(bad)])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a baseline without a PyTorch run was taken")
    assert "--baseline: " in capsys.readouterr().err


# A file where one test breaks the process for every test after it, as a CUDA error that
# stays with the context does: the later ones fail with it in one process and pass alone.
POISONING_TESTS = '''
import builtins

def check():
    if getattr(builtins, "_poisoned", False):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_a_fine():
    check()

def test_b_breaks_the_process():
    builtins._poisoned = True
    check()

class TestLater:
    def test_c_fine_alone(self):
        check()

    def test_d_fails_alone_too(self):
        check()
        assert False, "wrong on its own"

def test_e_fails_otherwise():
    check()
    raise ValueError("not a CUDA error")
'''


@pytest.mark.slow
def test_tests_failing_after_a_sticky_cuda_error_run_again_alone(tmp_path, capsys):
    out, printed = run_both(tmp_path, capsys, POISONING_TESTS, "test_poison.py")
    result = json.loads((out / "own-tests.json").read_text())
    for name in ("pytorch", "mempool"):
        r = result["runs"][name]
        assert r["first_sticky_error"] == "test_poison::test_b_breaks_the_process"
        assert r["rerun_alone"] == {"test_poison.TestLater::test_c_fine_alone": "passed",
                                    "test_poison.TestLater::test_d_fails_alone_too": "failed",
                                    "test_poison::test_e_fails_otherwise": "failed"}
        assert r["tests"]["test_poison.TestLater::test_c_fine_alone"][0] == "passed"
        assert "wrong on its own" in r["tests"]["test_poison.TestLater::test_d_fails_alone_too"][1]
        assert r["tests"]["test_poison::test_b_breaks_the_process"][0] == "failed"
    assert ("mempool: after test_poison::test_b_breaks_the_process failed with a CUDA error "
            "that stays with the process, 3 tests that failed with it ran again alone: "
            "1 passed, 2 failed, 0 skipped (own-tests-mempool.alone.log)") in printed
    assert "pytorch: 2 passed, 3 failed, 0 skipped" in printed, printed


def test_a_baseline_from_before_stand_ins_were_recorded_is_taken(tmp_path, capsys):
    """An own-tests.json written before the runs recorded `collected` and `stand_ins`."""
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(TESTS)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"runs": {"pytorch": {"rc": 1, "tests": {
        "test_sample::test_everywhere": ["passed", ""],
        "test_sample::test_only_without_the_pool": ["passed", ""]}}}}))
    assert torch_own_tests.main([str(test_file), str(tmp_path / "out"), "--timeout", "120",
                                 "--baseline", str(old)]) == 0
    printed = capsys.readouterr().out
    assert "pytorch: 2 passed, 0 failed, 0 skipped (exit status 1, from " in printed
    assert ("passed under PyTorch's allocator, not under mempool: 1\n"
            "  test_sample::test_only_without_the_pool") in printed


def test_a_cut_runs_log_is_compared_with_a_junit_baseline_by_the_same_names():
    """A run cut at its limit is read from its log, which names tests from their module on;
    a JUnit file names them from the folder the run started in. Both name one test the
    same in the comparison (a cut run under the pool was once listed as running nothing)."""
    runs = {
        "pytorch": {"tests": {".external.pytorch.test_cuda.TestCuda::test_a": ("passed", ""),
                              ".external.pytorch.test_cuda.TestCuda::test_b": ("passed", ""),
                              ".external.pytorch.test_cuda::test_c": ("passed", "")}},
        "mempool": {"tests": {"test_cuda.TestCuda::test_a": ("passed", ""),
                              "test_cuda.TestCuda::test_b": ("failed", ""),
                              "test_cuda::test_c": ("passed", "")}},
    }
    result = torch_own_tests.compare(runs, "test_cuda")
    assert result["passed_under_pytorch_only"] == {"test_cuda.TestCuda::test_b": "failed"}
    assert result["passed_under_mempool_only"] == []
    assert torch_own_tests.short_id("a.test_cuda.b.test_cuda.C::t", "test_cuda") == \
        "test_cuda.C::t"
    assert torch_own_tests.short_id("other.C::t", "test_cuda") == "other.C::t"


def test_under_a_budget_each_run_takes_what_the_one_before_left():
    # PyTorch's run first, at most half; the pool's takes four fifths of what is left then,
    # its reruns keeping the rest.
    assert torch_own_tests.run_limits("pytorch", 300) == (150, 1 / 3)
    assert torch_own_tests.run_limits("mempool", 250) == (200, 1.0)


def test_a_budget_sets_each_runs_limit_as_it_starts(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    seen = []

    def fake_run(name, test_file, outdir, select, timeout, extra, rerun_budget=None):
        seen.append((name, timeout, rerun_budget() if rerun_budget else None))
        return {"cmd": [], "rc": 0, "tests": {"test_x::test_x": ("passed", "")},
                "stand_ins": None, "collected": True}
    monkeypatch.setattr(torch_own_tests, "run", fake_run)
    clock = iter([0.0, 0.0, 0.0, 100.0, 100.0, 100.0, 100.0])
    monkeypatch.setattr(torch_own_tests.time, "monotonic", lambda: next(clock, 100.0))
    assert torch_own_tests.main([str(tmp_path / "test_x.py"), str(tmp_path / "out"),
                                 "--budget", "300"]) == 0
    # PyTorch's run starts with 300 s to go: 150, its reruns a third of what is left; it
    # took 100 s, so the pool's run starts with 200 to go: 160, its reruns the rest.
    assert seen == [("pytorch", 150, 100), ("mempool", 160, 200)]


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_a_budget_that_is_not_positive_is_refused(tmp_path, budget, capsys):
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    with pytest.raises(SystemExit):
        torch_own_tests.main([str(tmp_path / "test_x.py"), str(tmp_path / "out"),
                              "--budget", budget])
    assert "--budget: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
