"""bench/empty_pairs.py: the two children of a pair time their rounds in turn, alternating
which goes first, and a child that fails is named with its error output (no GPU needed: the
children here answer the lockstep protocol of mempool/bench/torch_empty_child.py)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import empty_pairs  # noqa: E402

FAKE_CHILD = r'''
import json, sys
name, log, ns = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("a notice before the child is ready", flush=True)
print("READY", flush=True)
rounds = 0
for line in sys.stdin:
    if line.strip() == "END":
        break
    size = int(line.split()[1])
    with open(log, "a") as f:
        f.write(f"{name} {size}\n")
    rounds += 1
    print(f"NS {ns + rounds}", flush=True)
print(json.dumps({"rounds_run": rounds}), flush=True)
'''


@pytest.fixture
def fake_child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    return str(script), str(tmp_path / "order.log")


def test_rounds_alternate_and_each_childs_figure_is_the_median_of_its_rounds(fake_child):
    script, log = fake_child
    out = empty_pairs.run_pair({"a": [script, "a", log, "100"], "b": [script, "b", log, "50"]},
                               None, (512, 4096), rounds=4)
    with open(log) as f:
        calls = f.read().split("\n")[:-1]
    assert calls == ["a 512", "b 512", "b 512", "a 512", "a 512", "b 512", "b 512", "a 512",
                     "a 4096", "b 4096", "b 4096", "a 4096", "a 4096", "b 4096", "b 4096",
                     "a 4096"]
    assert out["a"]["rounds"][512] == [101, 102, 103, 104]
    assert out["a"]["rounds"][4096] == [105, 106, 107, 108]
    assert out["b"]["ns_per_pair"][4096] == 56.5
    assert out["a"]["result"] == {"rounds_run": 8}
    assert empty_pairs.round_ratios(out["a"]["rounds"][512], out["b"]["rounds"][512]) == \
        [51 / 101, 52 / 102, 53 / 103, 54 / 104]


def test_with_a_floor_each_round_is_followed_by_a_floor_round_in_the_same_child(fake_child):
    script, log = fake_child
    out = empty_pairs.run_pair({"a": [script, "a", log, "100"], "b": [script, "b", log, "50"]},
                               None, (0, 512), rounds=2, floor=0)
    with open(log) as f:
        calls = f.read().split("\n")[:-1]
    # 0 B's own rounds first, then each 512 B round with its floor round right after it.
    assert calls == ["a 0", "b 0", "b 0", "a 0",
                     "a 512", "a 0", "b 512", "b 0", "b 512", "b 0", "a 512", "a 0"]
    # The fake child answers ns + its count of rounds: a's 512 B rounds were its 3rd and
    # 5th (103, 105), each followed by a floor round (104, 106).
    assert out["a"]["rounds"][512] == [103, 105]
    assert out["a"]["floor_rounds"] == {512: [104, 106]}
    assert out["a"]["share_per_pair"] == {512: -1}
    assert 0 not in out["a"]["share_per_pair"]
    assert empty_pairs.round_shares([10, 20], [4, 5]) == [6, 15]


def test_without_a_floor_no_floor_rounds_are_run(fake_child):
    script, log = fake_child
    out = empty_pairs.run_pair({"a": [script, "a", log, "100"], "b": [script, "b", log, "50"]},
                               None, (512,), rounds=2)
    assert "floor_rounds" not in out["a"] and "share_per_pair" not in out["a"]


def test_a_child_that_fails_is_named_with_its_error(tmp_path, fake_child):
    script, log = fake_child
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nsys.exit('no CUDA device here')\n")
    with pytest.raises(RuntimeError, match=r"b ended \(exit status 1\) before printing "
                                           r"'READY': no CUDA device here"):
        empty_pairs.run_pair({"a": [script, "a", log, "1"], "b": [str(broken)]}, None, (512,), 2)


def test_the_torch_empty_child_speaks_the_protocol(tmp_path):
    """The real child, with a stand-in for PyTorch (only torch.empty and synchronize)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "uint8 = 'uint8'\n"
        "calls = []\n"
        "def empty(n, dtype=None, device=None):\n"
        "    assert (dtype, device) == ('uint8', 'cuda')\n"
        "    return bytearray(n)\n"
        "class cuda:\n"
        "    synchronize = staticmethod(lambda: None)\n")
    child = os.path.join(ROOT, "mempool", "bench", "torch_empty_child.py")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = empty_pairs.run_pair({name: [child, "caching", "--lockstep", "50"] for name in "xy"},
                               None, (512, 65536), 3, env)
    for name in "xy":
        assert [len(out[name]["rounds"][size]) for size in (512, 65536)] == [3, 3]
        assert all(ns > 0 for ns in out[name]["rounds"][512] + out[name]["rounds"][65536])
        assert set(out[name]["result"]["context"]) == {"start", "before", "after"}


def test_the_control_runs_one_allocator_on_both_sides_and_reports_their_ratio(monkeypatch):
    """bench/torch_workloads.py --empty-control: each control pair is two children of the
    same allocator, and its figure per size is the second child's median over the first's."""
    import torch_workloads

    seen = []

    def fake_run_pair(children, cpu, sizes, rounds, env=None, floor=None):
        seen.append((children, cpu, floor))
        k = len(seen)
        return {"a": {"ns_per_pair": {size: 100.0 * k for size in sizes}},
                "b": {"ns_per_pair": {size: 100.0 * k + size % 7 for size in sizes}}}

    monkeypatch.setattr(empty_pairs, "run_pair", fake_run_pair)
    monkeypatch.setattr(torch_workloads, "fastest_cpus", lambda n: ({3}, {3: 12.0}))
    out = torch_workloads.run_empty_control("child.py", {}, "caching", 2, 5, 100)
    assert len(seen) == 2
    for children, cpu, floor in seen:
        assert children["a"] == children["b"] == ["child.py", "caching", "--lockstep", "100"]
        assert children["a"] is not children["b"]
        assert (cpu, floor) == (3, torch_workloads.EMPTY_FLOOR)
    assert out[1]["cpu"] == 3
    for size in torch_workloads.EMPTY_SIZES:
        assert out[1][str(size)] == (200.0 + size % 7) / 200.0


def test_a_control_pair_that_fails_is_kept_as_its_error(monkeypatch):
    import torch_workloads

    def failing(*args, **kwargs):
        raise RuntimeError("b ended (exit status 1) before printing 'READY': no device")

    monkeypatch.setattr(empty_pairs, "run_pair", failing)
    monkeypatch.setattr(torch_workloads, "fastest_cpus", lambda n: ({0}, {0: 12.0}))
    out = torch_workloads.run_empty_control("child.py", {}, "mempool", 1, 5, 100)
    assert out == [{"error": "b ended (exit status 1) before printing 'READY': no device"}]


def test_an_unknown_control_allocator_is_refused_before_anything_runs(tmp_path, capsys):
    import torch_workloads

    with pytest.raises(SystemExit) as info:
        torch_workloads.main([str(tmp_path / "out"), "--workloads", "empty",
                              "--empty-control", "caching,rmm"])
    assert info.value.code == 2
    assert "--empty-control: takes caching and/or mempool; got 'caching,rmm'" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def saved_process(ns, floor_rounds=None):
    """A process of a saved torch.empty run: its median ns per size, and for 512 B the 0 B
    rounds timed after its rounds."""
    r = {str(size): {"ns_per_pair": ns[size], "rounds": [ns[size]] * 3}
         for size in (0, 512)}
    if floor_rounds is not None:
        r["512"]["floor_rounds"] = floor_rounds
    return r


def test_the_bound_of_a_pair_is_its_mempool_processs_floor_over_its_partners_size():
    """process_bound: the ratio the pair would show were the allocator's share nil."""
    import torch_workloads

    caching = saved_process({0: 1800, 512: 2400})
    mempool = saved_process({0: 1700, 512: 2000}, floor_rounds=[1900, 1800, 2500])
    assert torch_workloads.process_bound(caching, mempool, "512") == 1900 / 2400
    assert torch_workloads.process_bound(caching, saved_process({0: 1, 512: 2}), "512") is None
    assert torch_workloads.process_bound(caching, mempool, "65536") is None
    assert torch_workloads.process_bound(caching, {"error": "no device"}, "512") is None


def test_the_slowest_mempool_process_is_set_against_pytorchs_median_process():
    import torch_workloads

    te = {"caching": [saved_process({0: 1, 512: n}) for n in (2000, 2400, 2200)],
          "mempool": [saved_process({0: 1, 512: n}) for n in (1700, 1990, 1800)]
          + [{"error": "no device"}]}
    assert torch_workloads.worst_over_median(te, "512") == 1990 / 2200
    assert torch_workloads.worst_over_median(te, "65536") is None


def test_a_saved_run_is_summarized_again_and_a_file_without_pairs_is_refused(tmp_path,
                                                                              capsys):
    import json
    import torch_workloads

    te = {"caching": [saved_process({0: 1800, 512: 2400})],
          "mempool": [saved_process({0: 1700, 512: 2000}, floor_rounds=[1900, 1800, 2500])],
          "ratios": [{"512": [0.8, 0.9, 0.85]}]}
    run = tmp_path / "workloads.json"
    run.write_text(json.dumps({"rows": [], "torch_empty": te}))
    assert torch_workloads.main(["--empty-summary", str(run)]) == 0
    out = capsys.readouterr().out
    assert "torch.empty 512 B, mempool / caching per pair of processes: 0.83 (worst 0.83)" in out
    assert ("torch.empty 512 B, per pair with no allocator cost (the mempool process's 0 B "
            "rounds over its partner's rounds at this size): 0.79 (worst 0.79)") in out
    assert "torch.empty 512 B, the slowest mempool process over PyTorch's median process: " \
        "0.83" in out
    assert "round by round: median 0.85, worst 0.90 over 3 rounds" in out

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    assert torch_workloads.main(["--empty-summary", str(other)]) == 2
    assert "holds no torch.empty pairs" in capsys.readouterr().err
    assert torch_workloads.main(["--empty-summary", str(tmp_path / "missing.json")]) == 2
    assert "--empty-summary: cannot read" in capsys.readouterr().err


def test_each_pair_is_kept_as_it_ends_so_a_run_cut_short_keeps_its_pairs(monkeypatch):
    """run_empty's on_pair hears of the results after every mixed and every control pair
    (torch_workloads.py saves workloads.json there)."""
    import torch_workloads

    def fake_run_pair(children, cpu, sizes, rounds, env=None, floor=None):
        def child(ns):
            return {"result": {}, "ns_per_pair": {size: ns for size in sizes},
                    "rounds": {size: [ns] * rounds for size in sizes}}
        return {name: child(100.0 + i) for i, name in enumerate(children)}

    monkeypatch.setattr(empty_pairs, "run_pair", fake_run_pair)
    monkeypatch.setattr(torch_workloads, "fastest_cpus", lambda n: ({2}, {2: 12.0}))
    seen = []
    results = torch_workloads.run_empty(
        "out", procs=2, rounds=3, controls=("caching",),
        on_pair=lambda r: seen.append((len(r["mempool"]), len(r.get("control", {}).get(
            "caching", [])))))
    assert seen == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert [r["512"]["ns_per_pair"] for r in results["mempool"]] == [101.0, 101.0]
    assert results["control"]["caching"][0]["512"] == 101.0 / 100.0
