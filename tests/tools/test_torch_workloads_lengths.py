"""bench/torch_workloads.py's GPT sequence lengths: the bucketed workload times only shapes
its warm-up has run, and the original one keeps the lengths of its recorded runs."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import torch_workloads as tw  # noqa: E402  (stdlib only at import)


def test_bucketed_warmup_runs_every_bucket_twice_before_the_timed_steps():
    warmup = 2 * len(tw.GPT_BUCKETS)
    lengths = tw.gpt_lengths(30, warmup, bucketed=True)
    assert len(lengths) == warmup + 30
    head, timed = lengths[:warmup], lengths[warmup:]
    assert sorted(head) == sorted(tw.GPT_BUCKETS * 2)
    assert set(timed) <= set(head)
    assert len(set(timed)) > 1   # still dynamic: the timed steps change shape


def test_unbucketed_lengths_are_those_of_the_recorded_runs():
    # The first lengths of `random.Random(1).randrange(64, 513)`, which the GPT runs in
    # bench/results/ (2026-12-03 on) trained on: a change would make them incomparable.
    assert tw.gpt_lengths(30, 10, bucketed=False)[:5] == [132, 355, 497, 474, 455]
    assert all(64 <= n <= 512 for n in tw.gpt_lengths(30, 10, bucketed=False))


def test_order_seed_draws_another_order_of_the_same_buckets_after_the_same_warmup():
    warmup = 2 * len(tw.GPT_BUCKETS)
    one, two = (tw.gpt_lengths(30, warmup, bucketed=True, seed=s) for s in (1, 2))
    assert one == tw.gpt_lengths(30, warmup, bucketed=True)   # seed 1: the recorded runs
    assert one[:warmup] == two[:warmup]
    assert one[warmup:] != two[warmup:] and set(two[warmup:]) <= set(tw.GPT_BUCKETS)


def test_the_llama_workload_is_registered_pinned_and_bucketed():
    assert "llama-bucketed" in tw.WORKLOADS and "llama-bucketed" in tw.PINNED_WORKLOADS
