"""bench/torch_own_tests.py runs a test file twice, as it is and under `python -m mempool
run`, and names what differs (no GPU needed: a file of tests that tell the two runs apart
by whether the pool's launcher started them)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_the_two_runs_and_what_differs(tmp_path, capsys):
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(TESTS)
    out = tmp_path / "out"
    assert torch_own_tests.main([str(test_file), str(out), "--timeout", "120"]) == 0
    printed = capsys.readouterr().out
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
