"""bench/fragmentation_gpu.py runs its rows in rounds, one process per row each, so that the
host's drift over a run falls on every row alike, and compares rows round by round. The
workers need a GPU; their order and the comparison do not."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
fragmentation_gpu = pytest.importorskip("fragmentation_gpu")


def test_rows_run_in_rounds_and_are_compared_round_by_round(monkeypatch):
    order, pinned = [], []

    def fake_process(worker_args, env, cpu):
        # The host slows down over the run: each round takes longer than the last, and B
        # is always 1.5x its round's A.
        pace = 1 + len(order) // 2
        order.append(worker_args[0])
        pinned.append(cpu)
        return {"ns_per_event": pace * (150.0 if worker_args[0] == "B" else 100.0)}

    monkeypatch.setattr(fragmentation_gpu, "_one_process", fake_process)
    rounds = iter([3, 5, 3])      # the fastest CPU before each round
    monkeypatch.setattr(fragmentation_gpu, "fastest_cpus",
                        lambda n: ({next(rounds)}, {}))
    a, b = fragmentation_gpu._interleaved(3, [("a", ["A"], {}), ("b", ["B"], {})])
    assert order == ["A", "B", "A", "B", "A", "B"]
    assert pinned == [3, 3, 5, 5, 3, 3]                   # a round's processes share a CPU
    assert a["ns_per_event_runs"] == [100.0, 200.0, 300.0]
    assert b["ns_per_event"] == 300.0                     # the median of the three rounds
    # Rows run one after the other (all of A, then all of B) would have put B's processes
    # on a slower host than A's (medians 750 against 200); round by round it is 1.5x.
    assert fragmentation_gpu.round_ratios(b, a) == [1.5, 1.5, 1.5]


def test_a_row_whose_worker_fails_reports_its_error_and_the_others_go_on(monkeypatch):
    order = []

    def fake_process(worker_args, env, cpu):
        order.append(worker_args[0])
        return {"error": "no device"} if worker_args[0] == "B" else {"ns_per_event": 1.0}

    monkeypatch.setattr(fragmentation_gpu, "_one_process", fake_process)
    monkeypatch.setattr(fragmentation_gpu, "fastest_cpus", lambda n: ({0}, {0: 1.0}))
    a, b = fragmentation_gpu._interleaved(2, [("a", ["A"], {}), ("b", ["B"], {})])
    assert order == ["A", "B", "A"]                       # B is not run again
    assert b == {"error": "no device"}
    assert a["ns_per_event_runs"] == [1.0, 1.0]
