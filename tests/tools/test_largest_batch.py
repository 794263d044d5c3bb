"""bench/largest_batch.py on sim: its search (mempool/bench/batch_search.py), its records, and
the relations its report claims.

The script runs as a user runs it, in a child process, on a small transformer (4 layers,
hidden 256, 8 steps) under a 768 MiB limit, with ``--scan``: every batch up to the bound is
also replayed afresh. The checks are relations, not figures of a past run: the search agrees
with a linear scan, every recorded trial is what a fresh replay gives, and expandable
segments fit at least the default pool's batch, which no allocator can push past the bound
(the live bytes alone).
"""
import json
import os
import subprocess
import sys

import pytest

from _support import ROOT
from mempool.bench.batch_search import MEMPOOL_CONFS, search

MiB = 1 << 20
LIMIT = 768 * MiB
SMALL = dict(layers=4, hidden=256, heads=4, vocab=8000, lengths=[64, 256], max_positions=256,
             steps=8)
DEFAULT, EXPANDABLE = (label for label, _ in MEMPOOL_CONFS[:2])
SEEDS = (1, 2, 3)


def run_script(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "largest_batch.py"),
                           *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Per seed: (the JSON the script wrote, what it printed)."""
    out = {}
    folder = tmp_path_factory.mktemp("largest_batch")
    for seed in SEEDS:
        path = folder / f"seed{seed}.json"
        p = run_script("--limit", "768MiB", "--seed", str(seed), "--model", json.dumps(SMALL),
                       "--mempool", DEFAULT, "--mempool", EXPANDABLE, "--scan",
                       "--out", str(path))
        assert p.returncode == 0, p.stdout + p.stderr
        out[seed] = (json.loads(path.read_text()), p.stdout)
    return out


def rows_of(result):
    return {r["allocator"]: r for r in result["rows"]}


@pytest.mark.parametrize("seed", SEEDS)
def test_expandable_segments_fit_at_least_the_default_batch(measured, seed):
    result, _ = measured[seed]
    rows = rows_of(result)
    default, expandable = rows[DEFAULT]["largest"], rows[EXPANDABLE]["largest"]
    assert default is not None
    assert default <= expandable <= result["live_bound"]["largest"]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_recorded_trial_is_what_a_fresh_replay_gives(measured, seed):
    result, _ = measured[seed]
    for label in (DEFAULT, EXPANDABLE):
        row = rows_of(result)[label]
        fresh = {t["batch"]: t for t in row["scan"]}
        trials = row["trials"]
        # The search crossed the boundary: it saw batches that fit and one that did not.
        assert any(t["fits"] for t in trials) and not all(t["fits"] for t in trials)
        for t in trials:
            again = fresh.get(t["batch"])
            if again is None:                     # above the scan: above the bound
                assert t["batch"] > result["live_bound"]["largest"] and not t["fits"]
                continue
            keys = ("fits", "num_ooms", "needed_live_bytes", "peak_live_bytes",
                    "peak_reserved_bytes")
            assert {k: t[k] for k in keys} == {k: again[k] for k in keys}, (label, t["batch"])
            if t["fits"]:
                assert t["num_ooms"] == 0 and t["peak_live_bytes"] == t["needed_live_bytes"]
                assert t["peak_live_bytes"] <= t["peak_reserved_bytes"] <= LIMIT
            else:
                assert t["num_ooms"] >= 1


@pytest.mark.parametrize("seed", SEEDS)
def test_search_against_a_linear_scan(measured, seed):
    """Where fitting is monotone in the batch the search finds what the scan finds. It is not
    always: near the limit a batch can OOM and a larger one fit (seed 3's default pool: 37-39
    OOM, 40 fits). The search then never reports less than the last batch before the scan's
    first OOM, reports a batch that fits, and has tried the --check-above batches above the
    boundary it bisected to."""
    result, _ = measured[seed]
    check_above = result["search"]["check_above"]
    for label in (DEFAULT, EXPANDABLE):
        row = rows_of(result)[label]
        fits = {t["batch"]: t["fits"] for t in row["scan"]}
        fitting = [b for b, ok in fits.items() if ok]
        first_oom = min(b for b, ok in fits.items() if not ok)
        assert first_oom - 1 <= row["largest"] <= max(fitting) and fits[row["largest"]]
        tried = {t["batch"] for t in row["trials"]}
        assert set(range(row["boundary"] + 1, row["boundary"] + check_above + 1)) <= tried
        if fitting == list(range(1, max(fitting) + 1)):
            assert row["largest"] == max(fitting), label
        # The search over the scan's outcomes, started elsewhere, agrees within the same terms.
        again = search(lambda b: {"batch": b, "fits": fits.get(b, False)}, 1, 4096)
        assert first_oom - 1 <= again["largest"] <= max(fitting)


def test_some_seed_is_monotone_so_the_equality_above_was_checked(measured):
    monotone = 0
    for result, _ in measured.values():
        for label in (DEFAULT, EXPANDABLE):
            fitting = [t["batch"] for t in rows_of(result)[label]["scan"] if t["fits"]]
            monotone += fitting == list(range(1, max(fitting) + 1))
    assert monotone >= 3


def test_the_bound_is_exact(measured):
    for result, _ in measured.values():
        bound = result["live_bound"]
        live = {t["batch"]: t["needed_live_bytes"] for t in bound["trials"]}
        b = bound["largest"]
        assert live[b] <= LIMIT < live[b + 1]


def test_the_report_and_its_json(measured):
    result, printed = measured[1]
    assert result["limit_bytes"] == LIMIT and result["backend"] == "sim"
    assert result["trace"]["params"]["layers"] == 4 and result["trace"]["params"]["steps"] == 8
    rows = rows_of(result)
    assert set(rows) == {DEFAULT, EXPANDABLE, "torch default", "torch expandable_segments:True"}
    for label in ("torch default", "torch expandable_segments:True"):
        assert "needs a GPU" in rows[label]["skipped"]
    assert "largest batch that fits in 768MiB (sim)" in printed and "steps 8" in printed
    assert "live bytes alone (the bound)" in printed
    line = next(x for x in printed.splitlines() if x.startswith(EXPANDABLE))
    assert line[len(EXPANDABLE):].split()[0].rstrip("*") == str(rows[EXPANDABLE]["largest"])


@pytest.mark.parametrize("args, fragment", [
    (["--model", "{"], "--model: not JSON"),
    (["--model", "[1]"], "--model: expected a JSON object, got list"),
    (["--model", '{"depth": 2}'], "transformer() has no parameter ['depth']"),
    (["--mempool", "mempool fastest"], "--mempool: no row 'mempool fastest'"),
])
def test_bad_arguments_are_named(args, fragment):
    p = run_script(*args)
    assert p.returncode == 2 and fragment in p.stderr, p.stderr


def _predicate(fitting):
    calls = []

    def trial(batch):
        calls.append(batch)
        return {"batch": batch, "fits": batch in fitting}
    return trial, calls


@pytest.mark.parametrize("start", [1, 5, 37, 100, 5000])
def test_search_on_a_monotone_predicate(start):
    trial, calls = _predicate(set(range(1, 38)))
    found = search(trial, start, 1000, check_above=2)
    assert found["largest"] == found["boundary"] == 37
    assert {t["batch"] for t in found["trials"]} == set(calls)
    assert len(calls) == len(set(calls)) <= 25          # galloping, not a scan
    assert {38, 39} <= set(calls)


def test_search_reports_a_fit_above_an_oom():
    # 40 fails but 41 fits: the bisection stops at 39, the check above finds 41
    trial, _ = _predicate(set(range(1, 40)) | {41})
    found = search(trial, 39, 1000, check_above=2)
    assert found["boundary"] == 39
    assert found["largest"] == 41
    assert search(trial, 39, 1000, check_above=0)["largest"] == 39


def test_search_when_nothing_or_everything_fits():
    trial, _ = _predicate(set())
    found = search(trial, 16, 1000)
    assert found["largest"] is None and found["boundary"] == 0
    trial, _ = _predicate(set(range(1, 2000)))
    found = search(trial, 1, 64)
    assert found["largest"] == found["boundary"] == 64
    assert max(t["batch"] for t in found["trials"]) == 64
