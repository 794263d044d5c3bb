"""bench/steady_steps.py finds the steps of a recorded gpt-bucketed run and counts the
upstream calls of its timed steps on sim."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import steady_steps  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402

MiB = 1 << 20


def gpt_like(lengths, per_step=300):
    """Parameters, then per step: input ids (8 x L int64) first, then `per_step` pairs of an
    activation's alloc and free, sized by L (a step of MIN_STEP_EVENTS or more events)."""
    ev, ident = [], 0

    def alloc(n):
        nonlocal ident
        ident += 1
        ev.append(mtrace.Event("alloc", ident, n, 0, len(ev)))
        return ident

    params = [alloc(4 * MiB) for _ in range(8)]
    starts = []
    for L in lengths:
        starts.append(len(ev))
        ids = alloc(steady_steps.IDS_BYTES * L)
        for k in range(per_step):
            a = alloc(L * 4096 + 512 * (k % 7))
            ev.append(mtrace.Event("free", a, 0, 0, len(ev)))
        ev.append(mtrace.Event("free", ids, 0, 0, len(ev)))
    for p in params:
        ev.append(mtrace.Event("free", p, 0, 0, len(ev)))
    return mtrace.Trace(ev), starts


def test_the_steps_are_found_at_each_input_ids_allocation():
    lengths = steady_steps.gpt_lengths(4, 16, bucketed=True)
    events, starts = gpt_like(lengths)
    assert steady_steps.step_starts(events, lengths) == starts


def test_a_snapshot_of_another_plan_is_refused_with_what_was_found():
    lengths = steady_steps.gpt_lengths(4, 16, bucketed=True)
    events, _ = gpt_like(lengths[:10])
    with pytest.raises(ValueError, match="found 10 of 20 steps"):
        steady_steps.step_starts(events, lengths)


def test_a_loop_whose_shapes_were_all_warmed_up_makes_no_call_in_its_timed_steps():
    lengths = steady_steps.gpt_lengths(4, 16, bucketed=True)
    events, _ = gpt_like(lengths)
    events.meta["step_starts"] = steady_steps.step_starts(events, lengths)
    for conf in ("expandable_segments:True,granularity:8MiB", "segment_rounding:32MiB"):
        s = steady_steps.summarize(events, conf, warmup=16)
        assert s["device_alloc"] > 0, s                     # the warm-up mapped memory
        assert (s["timed_device_alloc"], s["timed_device_free"],
                s["timed_stream_syncs"]) == (0, 0, 0), s
        assert len(s["per_step"]) == 1 + len(lengths)       # the set-up, then each step
