"""bench/batch_workloads.py and its place in bench/torch_workloads.py, without a GPU: the
search for the largest batch (largest_fitting) on fake trials, the workloads' runner on a
fake torch, the side-by-side table, and the command line's workloads and cap."""
import json
import math
import os
import random
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))
import batch_workloads as bw  # noqa: E402  (stdlib only at import)
import torch_workloads as tw  # noqa: E402


class Trials:
    """fits(batch) from a predicate, recording the batches asked in order."""

    def __init__(self, fits):
        self.fits, self.asked = fits, []

    def __call__(self, batch):
        self.asked.append(batch)
        return self.fits(batch)


# ---- the search ---------------------------------------------------------------------------

@pytest.mark.parametrize("answer", list(range(0, 130)) + [255, 256, 257, 1000, 4095])
def test_a_monotone_fit_finds_the_largest_batch_trying_each_once(answer):
    trials = Trials(lambda b: b <= answer)
    assert bw.largest_fitting(trials) == answer
    assert len(trials.asked) == len(set(trials.asked))
    assert all(1 <= b <= bw.MAX_BATCH for b in trials.asked)
    # About two tries per doubling from the start: galloping, then as many bisecting.
    assert len(trials.asked) <= 2 * math.log2(max(answer, bw.START)) + 2


def test_the_search_gallops_up_from_four_by_doubling_then_bisects():
    trials = Trials(lambda b: b <= 45)
    assert bw.largest_fitting(trials) == 45
    assert trials.asked == [4, 8, 16, 32, 64, 48, 40, 44, 46, 45]


@pytest.mark.parametrize("answer,asked", [(3, [4, 2, 3]), (2, [4, 2, 3]), (1, [4, 2, 1]),
                                          (0, [4, 2, 1])])
def test_a_first_batch_that_fails_searches_down_by_halving(answer, asked):
    trials = Trials(lambda b: b <= answer)
    assert bw.largest_fitting(trials) == answer
    assert trials.asked == asked


def test_a_larger_start_that_fails_halves_to_a_fit_then_bisects():
    trials = Trials(lambda b: b <= 37)
    assert bw.largest_fitting(trials, start=1000) == 37
    assert trials.asked[:6] == [1000, 500, 250, 125, 62, 31]
    assert trials.asked[-1] in (37, 38) and len(set(trials.asked)) == len(trials.asked)


def test_nothing_fits_is_zero_after_batch_one_failed():
    trials = Trials(lambda b: False)
    assert bw.largest_fitting(trials, start=64) == 0
    assert trials.asked == [64, 32, 16, 8, 4, 2, 1]


def test_the_upper_bound_stops_the_gallop_and_is_returned_as_reached():
    trials = Trials(lambda b: True)
    assert bw.largest_fitting(trials) == bw.MAX_BATCH == 4096
    assert trials.asked == [4 << k for k in range(11)]      # 4 ... 4096, nothing beyond
    trials = Trials(lambda b: True)
    assert bw.largest_fitting(trials, limit=100) == 100
    assert trials.asked == [4, 8, 16, 32, 64, 100]


def test_a_bound_that_is_no_power_of_two_still_bisects_below_it():
    trials = Trials(lambda b: b <= 80)
    assert bw.largest_fitting(trials, limit=100) == 80
    assert max(trials.asked) == 100


def test_start_above_the_bound_starts_at_the_bound():
    trials = Trials(lambda b: b <= 10)
    assert bw.largest_fitting(trials, start=50, limit=20) == 10
    assert trials.asked[0] == 20


@pytest.mark.parametrize("start,limit", [(0, 10), (-1, 10), (4, 0)])
def test_a_start_or_bound_below_one_is_refused(start, limit):
    with pytest.raises(ValueError, match="at least 1"):
        bw.largest_fitting(lambda b: True, start=start, limit=limit)


def test_not_monotone_near_the_boundary_the_answer_is_the_boundary_the_search_met():
    # Batches 33 and 34 fit although 21-32 do not: the search, having seen 32 fail, bisects
    # below it and never tries them. The answer fits and the batch above it failed.
    fitting = set(range(1, 21)) | {33, 34}
    trials = Trials(lambda b: b in fitting)
    assert bw.largest_fitting(trials) == 20
    assert 21 in trials.asked and 33 not in trials.asked
    # A hole below the answer that the bisection does not land on is not seen either.
    trials = Trials(lambda b: b <= 40 and b != 24)
    assert bw.largest_fitting(trials) == 40


def test_not_monotone_the_answer_fitted_and_the_batch_above_it_was_tried_and_failed():
    rng = random.Random(7)
    for _ in range(500):
        edge = rng.randrange(0, 300)
        flips = {rng.randrange(1, 400) for _ in range(rng.randrange(0, 8))}
        fitting = {b for b in range(1, 400) if (b <= edge) != (b in flips)}
        trials = Trials(lambda b: b in fitting)
        found = bw.largest_fitting(trials, start=rng.choice((1, 4, 16)), limit=512)
        assert len(trials.asked) == len(set(trials.asked))
        assert found == 0 or found in fitting
        assert found + 1 in trials.asked and found + 1 not in fitting


# ---- the runner on a fake torch -----------------------------------------------------------

class OOM(Exception):
    pass


def fake_torch(total=80 << 30):
    seen = {"fraction": None, "syncs": 0}

    def set_fraction(fraction, device):
        seen["fraction"] = fraction

    cuda = types.SimpleNamespace(
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=total),
        set_per_process_memory_fraction=set_fraction,
        synchronize=lambda: seen.__setitem__("syncs", seen["syncs"] + 1))
    return types.SimpleNamespace(cuda=cuda, OutOfMemoryError=OOM), seen


class Opt:
    def __init__(self):
        self.zeroed = 0

    def zero_grad(self, set_to_none=False):
        assert set_to_none
        self.zeroed += 1


def test_the_runner_sets_the_cap_before_the_model_and_records_every_trial():
    torch, seen = fake_torch()
    opt, built = Opt(), []

    def step(x):
        if x > 50:
            raise OOM("out of memory")

    def build():
        built.append(seen["fraction"])
        return step, opt

    row = bw.largest_batch(torch, 20, build, lambda torch, b: (b,))
    assert built == [20 / 80]
    assert row["largest_batch"] == 50 and row["cap_gib"] == 20
    assert row["reached_limit"] is False and row["search_limit"] == bw.MAX_BATCH
    assert row["trials"][:5] == [[4, True], [8, True], [16, True], [32, True], [64, False]]
    assert opt.zeroed == len(row["trials"])        # a failed trial's gradients dropped too
    assert row["ms_per_step"] is None and row["values"] == []
    json.dumps(row)


def test_an_error_other_than_out_of_memory_ends_the_run():
    torch, _ = fake_torch()

    def step(x):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    with pytest.raises(RuntimeError, match="CUBLAS"):
        bw.largest_batch(torch, 20, lambda: (step, Opt()), lambda torch, b: (b,))


def test_a_cap_above_the_devices_memory_is_refused():
    torch, seen = fake_torch(total=16 << 30)
    with pytest.raises(ValueError, match="exceeds the device's 16.0 GiB"):
        bw.largest_batch(torch, 24, lambda: pytest.fail("built"), bw.tokens)
    assert seen["fraction"] is None


def test_a_search_that_reaches_its_limit_says_so():
    torch, _ = fake_torch()
    row = bw.largest_batch(torch, 8, lambda: (lambda x: None, Opt()), lambda torch, b: (b,),
                           limit=64)
    assert (row["largest_batch"], row["reached_limit"]) == (64, True)


@pytest.mark.parametrize("workload,trainer,model,inputs", [
    ("batch", "lm_trainer", "gpt_model", bw.tokens),
    ("batch-llama", "lm_trainer", "llama_model", bw.tokens),
    ("batch-resnet", "resnet_trainer", None, bw.images)])
def test_each_workload_runs_its_models_step_under_the_cap(monkeypatch, workload, trainer,
                                                           model, inputs):
    calls = []
    monkeypatch.setattr(tw, "BATCH_CAP_GIB", 12.5)
    monkeypatch.setattr(tw.batch_workloads, "largest_batch",
                        lambda torch, cap, build, make: calls.append((cap, build(), make)))
    monkeypatch.setattr(tw, "lm_trainer", lambda torch, make_model=tw.gpt_model:
                        ("lm_trainer", make_model))
    monkeypatch.setattr(tw, "resnet_trainer", lambda torch: ("resnet_trainer", None))
    tw.WORKLOADS[workload]("torch", 30)
    expected = (trainer, getattr(tw, model) if model else None)
    assert calls == [(12.5, expected, inputs)]


# ---- the table and the command line -------------------------------------------------------

def test_the_table_sets_the_models_side_by_side_per_allocator():
    rows = [{"workload": "batch-resnet", "allocator": "torch", "largest_batch": 180,
             "cap_gib": 24.0},
            {"workload": "batch", "allocator": "mempool", "largest_batch": 4096,
             "reached_limit": True, "cap_gib": 24.0},
            {"workload": "batch", "allocator": "torch", "largest_batch": 56, "cap_gib": 24.0},
            {"workload": "batch", "allocator": "mempool-expandable", "error": "boom"},
            {"workload": "gpt", "allocator": "torch", "ms_per_step": 80.0}]
    lines = bw.side_by_side(rows, tw.ALLOCATORS).splitlines()
    assert lines[0] == "largest batch under a 24 GiB cap"
    assert lines[1] == "| model | torch | mempool | mempool-expandable |"
    assert lines[3] == "| GPT-2 style decoder, length 512 | 56 | >=4096 | - |"
    assert lines[4] == "| ResNet-50, 224x224 images | 180 | - | - |"
    assert len(lines) == 5
    assert bw.side_by_side(rows[-1:], tw.ALLOCATORS) == ""


def test_the_new_workloads_are_registered_and_run_once_each_under_the_cap(
        tmp_path, monkeypatch, capsys):
    assert set(bw.WORKLOADS) <= set(tw.WORKLOADS)
    assert not set(bw.WORKLOADS) & set(tw.PINNED_WORKLOADS)   # not timed: not pinned
    spawned = []

    def fake_spawn(args, env_extra=None, timeout=900, cpus=None):
        spawned.append(args)
        workload = args[args.index("--child") + 1]
        cap = float(args[args.index("--batch-cap-gib") + 1])
        return {"largest_batch": 10 + len(workload), "cap_gib": cap, "values": [],
                "ms_per_step": None, "peak_reserved": 1 << 30}

    monkeypatch.setattr(tw, "spawn", fake_spawn)
    out = tmp_path / "out"
    assert tw.main([str(out), "--workloads", "batch,batch-resnet,batch-llama",
                    "--batch-cap-gib", "16", "--reps", "3"]) == 0
    # One run per allocator and workload, whatever --reps says: the search is not timed.
    assert len(spawned) == 3 * len(tw.ALLOCATORS)
    assert {a[a.index("--child") + 1] for a in spawned} == set(bw.WORKLOADS)
    rows = json.loads((out / "workloads.json").read_text())["rows"]
    assert {(r["workload"], r["allocator"]) for r in rows} == {
        (w, a) for w in bw.WORKLOADS for a in tw.ALLOCATORS}
    assert all(r["cap_gib"] == 16.0 for r in rows)
    printed = capsys.readouterr().out
    assert "largest batch under a 16 GiB cap" in printed
    assert "| Llama-style decoder, length 512 | 21 | 21 | 21 | 21 |" in printed


def test_the_child_reads_the_cap_from_the_command_line(monkeypatch):
    seen = []
    monkeypatch.setattr(tw, "child", lambda w, a, steps, snap: seen.append(
        (w, a, tw.BATCH_CAP_GIB)) or 0)
    monkeypatch.setattr(tw, "BATCH_CAP_GIB", tw.BATCH_CAP_GIB)
    assert tw.main(["--child", "batch-llama", "mempool", "--batch-cap-gib", "30.5"]) == 0
    assert seen == [("batch-llama", "mempool", 30.5)]


def test_an_unknown_workload_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tw, "spawn", lambda *a, **k: pytest.fail("spawned"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        tw.main([str(out), "--workloads", "batch,batch-vit"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--workloads: unknown batch-vit; known: " in err
    assert all(w in err for w in bw.WORKLOADS) and "empty" in err
    assert not out.exists()


@pytest.mark.parametrize("cap", ["0", "-4", "nan"])
def test_a_cap_that_is_not_a_positive_size_is_refused(tmp_path, capsys, cap):
    with pytest.raises(SystemExit) as e:
        tw.main([str(tmp_path / "out"), "--workloads", "batch", "--batch-cap-gib", cap])
    assert e.value.code == 2
    assert "--batch-cap-gib: takes a size in GiB above 0" in capsys.readouterr().err
