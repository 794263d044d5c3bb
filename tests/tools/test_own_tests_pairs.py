"""PyTorch's own tests as several (file, selection) pairs: bench/torch_own_tests_pairs.py shares
one budget among them, bench/collect_results.py makes a table of each pair's own-tests.json
with the tests that passed under PyTorch's allocator only, and bench/render_benchmarks.py lays
them out (no GPU: the files here are written as the scripts write them)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import collect_results  # noqa: E402
import render_benchmarks  # noqa: E402
import torch_own_tests_pairs as pairs  # noqa: E402

VERSIONS = """date: 2000-01-02T03:04:05Z
commit: abcdef0123456789
NVIDIA H100 80GB HBM3, 580.00, 81559 MiB
Python 3.12.0
torch 2.11.0
"""


def own_tests_json(file, select, pytorch, mempool, only_pytorch):
    """An own-tests.json as bench/torch_own_tests.py writes it (the parts read here)."""
    return {"file": file, "select": select, "runs": {},
            "counts": {"pytorch": dict(zip(("passed", "failed", "skipped"), pytorch)),
                       "mempool": dict(zip(("passed", "failed", "skipped"), mempool))},
            "passed_under_pytorch_only": only_pytorch, "passed_under_mempool_only": []}


def write_run(out):
    (out / "versions.txt").write_text(VERSIONS)
    folder = out / "own-tests"
    for name, data in (
            ("multiprocessing-cuda", own_tests_json(
                "test_multiprocessing.py", "cuda or event", (20, 1, 3), (18, 3, 3),
                {"test_multiprocessing.TestMultiprocessing::test_cuda_simple":
                     "failed: RuntimeError: sharing `x` refused\nTraceback line two",
                 "test_multiprocessing.TestMultiprocessing::test_event": "not run"})),
            ("cuda-memory", own_tests_json(
                "test_cuda.py", "memory", (50, 2, 7), (50, 2, 7), {}))):
        (folder / name).mkdir(parents=True)
        (folder / name / "own-tests.json").write_text(json.dumps(data))
    # The order the pairs ran in, which the tables keep (not the folders' alphabetical one).
    (folder / "own-tests-pairs.json").write_text(json.dumps({"pairs": [
        {"name": "multiprocessing-cuda", "file": "test_multiprocessing.py", "select": "",
         "rc": 0, "seconds": 100},
        {"name": "cuda-memory", "file": "test_cuda.py", "select": "", "rc": 0,
         "seconds": 100}]}))


def test_each_pair_is_a_table_of_counts_with_the_tests_passing_under_pytorch_only(tmp_path):
    write_run(tmp_path)
    data = collect_results.collect(str(tmp_path))
    own = [f for f in data["figures"] if f["table"].startswith("PyTorch's own tests")]
    tables = list(dict.fromkeys(f["table"] for f in own))
    assert tables == ["PyTorch's own tests: multiprocessing-cuda",
                      "PyTorch's own tests: cuda-memory"]
    cell = {(f["table"].split(": ")[1], f["row"], f["column"]): f["median"] for f in own}
    assert cell[("multiprocessing-cuda", "under PyTorch's allocator", "passed")] == 20
    assert cell[("multiprocessing-cuda", "under mempool", "failed")] == 3
    assert cell[("cuda-memory", "under mempool", "skipped")] == 7
    mp = next(f for f in own if f["table"].endswith("multiprocessing-cuda"))
    assert mp["command"] == ("python bench/torch_own_tests.py test_multiprocessing.py OUT "
                             "--select 'cuda or event'")
    assert mp["commit"] == "abcdef0" and mp["unit"] == "tests"
    listed = data["test_lists"]["PyTorch's own tests: multiprocessing-cuda"]
    assert listed["items"] == [
        ["test_multiprocessing.TestMultiprocessing::test_cuda_simple",
         "failed: RuntimeError: sharing `x` refused Traceback line two"],
        ["test_multiprocessing.TestMultiprocessing::test_event", "not run"]]
    assert data["test_lists"]["PyTorch's own tests: cuda-memory"]["items"] == []


def test_the_tables_and_lists_render_into_benchmarks_md(tmp_path):
    write_run(tmp_path)
    data = collect_results.collect(str(tmp_path))
    results = tmp_path / "results"
    results.mkdir()
    (results / "h100.json").write_text(json.dumps(data))
    text = render_benchmarks.render(str(results))
    mp = text[text.index("### PyTorch's own tests: multiprocessing-cuda"):]
    mp = mp[:mp.index("### PyTorch's own tests: cuda-memory")]
    assert "| under PyTorch's allocator | 20 | 1 | 3 |" in mp
    assert "| under mempool | 18 | 3 | 3 |" in mp
    assert "Passed under PyTorch's allocator, not under mempool: 2." in mp
    # The message's backticks would end the test's code span: they become quotes.
    assert ("- `test_multiprocessing.TestMultiprocessing::test_cuda_simple`: failed: "
            "RuntimeError: sharing 'x' refused Traceback line two") in mp
    assert "- `test_multiprocessing.TestMultiprocessing::test_event`: not run" in mp
    assert "Passed under PyTorch's allocator, not under mempool: none." in \
        text[text.index("### PyTorch's own tests: cuda-memory"):]


def test_a_new_run_replaces_the_lists_of_the_tables_it_measured_and_keeps_the_others(tmp_path):
    old = {"card": "NVIDIA H100", "environment": "", "figures": [],
           "test_lists": {"PyTorch's own tests: cuda-memory": {"title": "t", "items": [["a", ""]]},
                          "PyTorch's own tests: gone": {"title": "t", "items": [["b", ""]]}}}
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(old))
    (tmp_path / "run").mkdir()
    write_run(tmp_path / "run")
    merged = collect_results.merge(str(path), collect_results.collect(str(tmp_path / "run")))
    assert merged["test_lists"]["PyTorch's own tests: cuda-memory"]["items"] == []
    assert merged["test_lists"]["PyTorch's own tests: gone"]["items"] == [["b", ""]]


def test_an_unreadable_pair_is_named_and_the_others_are_kept(tmp_path, capsys):
    write_run(tmp_path)
    (tmp_path / "own-tests" / "cuda-memory" / "own-tests.json").write_text("{not json")
    data = collect_results.collect(str(tmp_path))
    assert {f["table"] for f in data["figures"]} == {"PyTorch's own tests: multiprocessing-cuda"}
    assert "cuda-memory/own-tests.json: not read" in capsys.readouterr().err


def test_the_budget_is_shared_as_the_pairs_run():
    todo = [("a", "f", ""), ("b", "f", ""), ("c", "f", "")]
    assert pairs.plan(todo, 900, 0, 0) == 300
    # The first pair took 100 s of its 300: the two after it share what is left.
    assert pairs.plan(todo[1:], 900, 0, 100) == 400
    assert pairs.plan(todo[2:], 900, 0, 500) == 400


def test_a_pair_without_its_file_is_skipped_and_said(tmp_path, capsys):
    out = tmp_path / "out"
    assert pairs.main([str(out), "--tests", str(tmp_path), "--only", "cuda-graphs"]) == 1
    printed = capsys.readouterr().out
    assert f"cuda-graphs: no file {tmp_path / 'test_cuda.py'}: skipped" in printed
    assert "own tests: 0 of 1 pairs ran (cuda-graphs: no file)" in printed
    done = json.loads((out / "own-tests-pairs.json").read_text())["pairs"]
    assert done == [{"name": "cuda-graphs", "file": "test_cuda.py",
                     "select": dict((n, s) for n, _, s in pairs.PAIRS)["cuda-graphs"],
                     "rc": "no file", "seconds": 0}]


@pytest.mark.parametrize("args, message", [
    (["--only", "cuda-memry"], "--only: no pair named cuda-memry"),
    (["--budget", "0"], "--budget: 0 is not a positive number"),
    (["--pair", "x", "a.py", "", "--pair", "x", "b.py", ""], "the name 'x' is empty, a path or repeated"),
    (["--pair", "../up", "a.py", ""], "the name '../up' is empty, a path or repeated"),
])
def test_bad_arguments_are_named(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        pairs.main([str(tmp_path / "out"), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_pairs_run_under_both_allocators_within_the_budget(tmp_path, capsys):
    tests = tmp_path / "test_sample.py"
    tests.write_text("import sys\n\ndef test_a():\n    pass\n\n"
                     "def test_b():\n    assert 'mempool.run' not in sys.modules, 'pool'\n")
    out = tmp_path / "out"
    assert pairs.main([str(out), "--budget", "600", "--pair", "one", str(tests), "test_a",
                       "--pair", "two", str(tests), "test_b"]) == 0
    printed = capsys.readouterr().out
    assert "own tests: 2 of 2 pairs ran (one: 0, two: 0)" in printed
    one = json.loads((out / "one" / "own-tests.json").read_text())
    two = json.loads((out / "two" / "own-tests.json").read_text())
    assert one["select"] == "test_a" and one["passed_under_pytorch_only"] == {}
    assert list(two["passed_under_pytorch_only"]) == ["test_sample::test_b"]
    data = collect_results.collect(str(tmp_path / "out" / ".."))
    assert {f["table"] for f in data["figures"]} == set()   # no own-tests/ folder there
    (tmp_path / "run").mkdir()
    os.rename(out, tmp_path / "run" / "own-tests")
    data = collect_results.collect(str(tmp_path / "run"))
    assert [t for t in data["test_lists"]] == ["PyTorch's own tests: one",
                                               "PyTorch's own tests: two"]
