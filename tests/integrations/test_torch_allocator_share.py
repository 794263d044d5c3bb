"""The benchmarks that separate the allocator's part of torch.empty from the rest:
bench/torch_workloads.py's figures less the 0 B floor, and bench/torch_allocator_pairs.py's
summary of C++-timed pairs. Both read figures only, so they run without a GPU."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import torch_allocator_pairs as tap  # noqa: E402  (stdlib only at import)
import torch_workloads as tw  # noqa: E402


def test_the_floor_is_one_of_the_sizes_timed():
    assert tw.EMPTY_FLOOR in tw.EMPTY_SIZES and tw.EMPTY_FLOOR == 0


def test_an_allocators_share_is_its_processes_median_of_round_less_floor():
    caching = {"512": {"ns_per_pair": 2200.0, "share_ns_per_pair": 400.0}}
    mempool = {"512": {"ns_per_pair": 2050.0, "share_ns_per_pair": 150.0}}
    assert tw.allocator_shares(caching, mempool, "512") == (400.0, 150.0)


def test_a_process_without_a_floor_has_no_share():
    caching = {"512": {"ns_per_pair": 2200.0}}
    mempool = {"512": {"ns_per_pair": 2050.0, "share_ns_per_pair": 150.0}}
    assert tw.allocator_shares(caching, mempool, "512") is None


def test_the_pairs_summary_gives_medians_worst_process_and_ratios_by_process():
    def proc(ns):
        return {**{str(s): {"ns_per_pair": ns} for s in tap.SIZES},
                "pieces": {"cudaGetDevice": ns / 10}}

    procs = {"caching": [proc(300.0), proc(500.0), proc(400.0)],
             "mempool": [proc(60.0), proc(50.0), proc(120.0)]}
    first = tap.summarize(procs).splitlines()[0]
    assert first.startswith("512 B: PyTorch median 400.0 ns (worst 500.0), mempool median "
                            "60.0 ns (worst 120.0)")
    assert first.endswith("0.20, 0.10, 0.30 (worst 0.30)")
    pieces = [line for line in tap.summarize(procs).splitlines()
              if line.startswith("cudaGetDevice:")]
    assert pieces == ["cudaGetDevice: caching median 40.0 ns (worst 50.0); mempool median "
                      "6.0 ns (worst 12.0)"]
