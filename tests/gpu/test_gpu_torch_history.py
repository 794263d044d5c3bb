"""Memory history, snapshots and trace trackers under the pool, in PyTorch's own formats.

The scripts use PyTorch's own API only, as a training or inference script would, and check
that the answers are the pool's (each in a fresh interpreter: tests/_torch_scripts.py)."""
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import PRELUDE, run, TRACKER_SOURCE, TRACKER_BUILD, NATIVE_PRELUDE  # noqa: E402


def test_memory_history_and_snapshot_in_pytorch_format():
    run("""
        torch.cuda.memory._record_memory_history(max_entries=1000)
        a = torch.randn(1 << 20, device="cuda")
        b = torch.randn(256, device="cuda")
        del b
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        actions = [e["action"] for e in snap["device_traces"][0]]
        assert "alloc" in actions and "free_completed" in actions, actions
        assert any(e["frames"] for e in snap["device_traces"][0] if e["action"] == "alloc")
        seg_total = sum(s["total_size"] for s in snap["segments"])
        assert seg_total == pool.reserved_bytes(), (seg_total, pool.reserved_bytes())
        from torch.cuda import _memory_viz
        html = _memory_viz.trace_plot(snap)
        assert "<html" in html.lower() or len(html) > 1000
        _memory_viz.segment_plot(snap)
    """)


@pytest.mark.parametrize("expandable", [False, True])
def test_the_snapshots_allocator_settings_are_defined(expandable):
    # They were read from uninitialized members: a garbage collection threshold of
    # 2.8e-317 and expandable segments on a pool without them, in recorded snapshots.
    prelude = PRELUDE.replace('device=0)', 'device=0, expandable_segments=True)')
    run("""
        a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        settings = torch.cuda.memory._snapshot()["allocator_settings"]
        assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "mempool", settings
        assert settings["garbage_collection_threshold"] == 0.0, settings
        assert settings["expandable_segments"] == pool.options["expandable_segments"], settings
        for key in ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register"):
            assert not settings[key], settings
        print("settings ok", settings)
    """, prelude=prelude if expandable else PRELUDE)


def test_the_snapshot_has_record_function_annotations_and_times_in_us():
    # recordAnnotation keeps record_function's marks while history is on; times are µs since
    # the epoch, as PyTorch's allocator converts its approximate clock (they were TSC reads).
    run("""
        import time
        torch.cuda.memory._record_memory_history(max_entries=1000,
                                                 global_record_annotations=True)
        with torch.profiler.record_function("mempool-range"):
            x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del x
        snap = torch.cuda.memory._snapshot()
        marks = snap["external_annotations"]
        assert "mempool-range" in [m.get("name") for m in marks], marks
        now_us = time.time() * 1e6
        times = [e["time_us"] for e in snap["device_traces"][0]]
        times += [m.get("time_us") for m in marks]
        assert times and all(abs(t - now_us) < 600e6 for t in times), (times[:4], now_us)
        torch.cuda.memory._record_memory_history(enabled=None)
        print("annotations ok", marks[:2])
    """)


def test_the_snapshots_allocator_settings_are_the_pools():
    # From the table's config entry: PyTorch's keys (rounding divisions by interval start in
    # MB, max_split_size -1 for none), the pool's values.
    prelude = PRELUDE.replace('device=0)', 'device=0, garbage_collection_threshold=0.6, '
                                           'roundup_power2_divisions={256: 1, ">": 8})')
    assert prelude != PRELUDE
    run("""
        settings = torch.cuda.memory._snapshot()["allocator_settings"]
        assert settings["garbage_collection_threshold"] == 0.6, settings
        divisions = settings["roundup_power2_divisions"]
        assert list(divisions)[:3] == ["1", "2", "4"], settings
        assert list(divisions.values()) == pool.options["roundup_power2_divisions"], settings
        assert settings["max_split_size"] == -1, settings
        print("settings ok", settings)
    """, prelude=prelude)


@pytest.mark.parametrize("expandable", [False, True])
def test_the_snapshot_trace_has_the_pools_segment_events(expandable):
    # Note [Segment observer]: memory_viz's allocator state history replays these.
    prelude = PRELUDE.replace('device=0)', 'device=0, expandable_segments=True)')
    assert prelude != PRELUDE
    run("""
        torch.cuda.memory._record_memory_history(max_entries=10000)
        before = pool.stats()["num_device_alloc"]
        a = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")   # a segment of its own
        made = pool.stats()["num_device_alloc"] - before
        del a
        torch.cuda.empty_cache()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][0]
        actions = [e["action"] for e in trace]
        grow, give = (("segment_map", "segment_unmap") if pool.options["expandable_segments"]
                      else ("segment_alloc", "segment_free"))
        grown = [e for e in trace if e["action"] == grow]
        assert made and len(grown) == made, (made, actions)
        first_alloc = actions.index("alloc")
        assert actions.index(grow) < first_alloc, actions       # the segment before its block
        given = [e for e in trace if e["action"] == give]
        assert sum(e["size"] for e in given) >= 300 << 20, actions
        assert actions.index(give) > actions.index("free_completed"), actions
        from torch.cuda import _memory_viz
        _memory_viz.trace_plot(snap)
        _memory_viz.segment_plot(snap)
        print("segment events ok", made, len(given))
    """, prelude=prelude if expandable else PRELUDE)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_trace_tracker_sees_segments_with_history_off(expandable):
    # PyTorch hands every trace entry to attachAllocatorTraceTracker's trackers whether or
    # not history is recorded: ProcessGroupNCCL registers each new segment with NCCL that way
    # (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK). The tracker here is C++ built against
    # the installed PyTorch with the glue's own toolchain, as NCCL's hook is C++.
    prelude = PRELUDE.replace('device=0)', 'device=0, expandable_segments=True)')
    assert prelude != PRELUDE
    build = f"SOURCE = {TRACKER_SOURCE!r}\n" + TRACKER_BUILD
    run("""
        torch.cuda.init()
        tracker.tracker_attach()
        assert not torch.cuda.memory._snapshot()["device_traces"][0]   # history is off
        a = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")   # a segment of its own
        ptr = a.data_ptr()
        del a
        torch.cuda.empty_cache()
        seen = tracked()
        actions = [e[0] for e in seen]
        grow, give = (("segment_map", "segment_unmap") if pool.options["expandable_segments"]
                      else ("segment_alloc", "segment_free"))
        grown = [e for e in seen if e[0] == grow and e[1] <= ptr < e[1] + e[2]]
        assert grown and grown[0][2] >= 300 << 20, seen
        alloc_at = actions.index("alloc")
        assert seen[alloc_at][1] == ptr and seen.index(grown[0]) < alloc_at, seen
        given = [e for e in seen if e[0] == give]
        assert sum(e[2] for e in given) >= 300 << 20, seen
        assert actions.index(give) > actions.index("free_completed"), seen
        assert not torch.cuda.memory._snapshot()["device_traces"][0]   # and kept nothing
        print("tracker ok", len(seen))
    """, prelude=(prelude if expandable else PRELUDE) + build)


# Compares the device's free bytes at two moments: another test on the device moves them.
@pytest.mark.gpu_exclusive
@pytest.mark.parametrize("allocator", ["pytorch", "mempool"])
def test_a_trace_tracker_hears_of_a_segment_free_while_its_memory_is_still_held(allocator):
    # PyTorch hands its trackers a segment_free before its cudaFree: ProcessGroupNCCL's
    # registration hook deregisters the segment from NCCL there, while the memory is still
    # the allocator's. Under the pool the trackers are told just before the pool gives the
    # segment back (Note [Release observer] in mp_core.h); before that change they heard of
    # it after empty_cache had given the memory back to the device. The device's free bytes
    # as the tracker heard of the segment_free must lie the segment's size under what is
    # free after empty_cache.
    build = f"SOURCE = {TRACKER_SOURCE!r}\n" + TRACKER_BUILD
    prelude = NATIVE_PRELUDE if allocator == "pytorch" else PRELUDE
    run("""
        torch.cuda.init()
        tracker.tracker_attach()
        nbytes = 512 << 20
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")   # a segment of its own
        ptr = a.data_ptr()
        del a
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_after = torch.cuda.mem_get_info()[0]
        seen = tracked()
        freed = [e for e in seen if e[0] == "segment_free" and e[1] <= ptr < e[1] + e[2]]
        assert len(freed) == 1 and freed[0][2] >= nbytes, seen
        free_when_told = freed[0][3]
        assert free_when_told > 0, seen
        assert free_after - free_when_told >= nbytes, (free_after, free_when_told, seen)
        print("told first", free_after - free_when_told)
    """, prelude=prelude + build)


@pytest.mark.parametrize("allocator", ["pytorch", "mempool"])
def test_a_trace_trackers_error_at_a_segment_free_fails_empty_cache(allocator):
    # PyTorch's empty_cache lets a tracker's error through (NCCL's hook refuses to deregister
    # a segment it never registered). Under the pool the trackers are told from the core's
    # release, which an exception cannot cross: the glue keeps it and empty_cache raises it
    # once the segments have gone (Note [Release observer]). Allocation goes on after it.
    build = f"SOURCE = {TRACKER_SOURCE!r}\n" + TRACKER_BUILD
    prelude = NATIVE_PRELUDE if allocator == "pytorch" else PRELUDE
    out = run("""
        torch.cuda.init()
        tracker.tracker_attach_refusing()
        a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")   # a segment of its own
        del a
        try:
            torch.cuda.empty_cache()
        except RuntimeError as e:
            assert "the tracker refused a segment_free" in str(e), e
        else:
            raise AssertionError("empty_cache hid the tracker's error")
        b = torch.ones(1 << 20, device="cuda")
        assert b.sum().item() == 1 << 20
        print("tracker error raised")
    """, prelude=prelude + build)
    assert "tracker error raised" in out


@pytest.mark.parametrize("allocator", ["pytorch", "mempool"])
def test_nccls_tensor_registration_hook_follows_the_pools_segments(allocator):
    # ProcessGroupNCCL with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 registers every
    # segment of the allocator's snapshot with its communicator when the communicator is
    # made, and then, through a trace tracker, each new segment after its segment_alloc and
    # deregisters each one at its segment_free; PyTorch refuses to deregister a segment it
    # never registered. One rank on one GPU: the hook is PyTorch's own code, run against the
    # pool's snapshot and segment events, with collectives on tensors in new segments before
    # and after empty_cache gave segments back.
    prelude = NATIVE_PRELUDE if allocator == "pytorch" else PRELUDE
    out = run("""
        import os
        import torch.distributed as dist
        os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
        assert dist.is_nccl_available()
        warm = torch.ones(1 << 20, device="cuda")          # a segment before the group
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        for step in range(3):
            x = torch.full((96 << 20,), float(step + 1), device="cuda")   # a new segment
            dist.all_reduce(x)
            torch.cuda.synchronize()
            assert x[0].item() == step + 1 and x[-1].item() == step + 1
            del x
            torch.cuda.empty_cache()                       # its segment deregistered, freed
        dist.all_reduce(warm)
        torch.cuda.synchronize()
        assert warm.sum().item() == 1 << 20
        dist.destroy_process_group()
        print("nccl hook ok")
    """, prelude=prelude)
    assert "nccl hook ok" in out


def test_history_as_pytorchs_own_records_it():
    """What PyTorch's own test_memory_plots_* ask of history: turning it off drops the trace,
    every entry carries the user metadata, and a segment given back by empty_cache() carries
    empty_cache's stack when history records stacks for every action (Note [Segment event
    stacks])."""
    run("""
        import json
        def the_release():
            torch.cuda.empty_cache()
        for context in ("alloc", "all", "state"):
            torch.cuda.empty_cache()
            torch.cuda.memory._set_memory_metadata("metadata test")
            torch.cuda.memory._record_memory_history(context=context)
            x = torch.rand(3, 4, device="cuda")
            del x
            the_release()
            torch.cuda.memory._set_memory_metadata("")
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(None)
            trace = snap["device_traces"][0]
            actions = [e["action"] for e in trace]
            ours = [e for e in trace if e["action"] == "alloc" and e["size"] == 48]
            assert len(ours) == 1 and "segment_free" in actions, actions   # this round's only
            assert all(e["user_metadata"] == "metadata test" for e in trace), trace
            assert ("the_release" in json.dumps(snap)) == (context == "all"), context
        torch.cuda.memory._record_memory_history(context="all")
        torch.cuda.memory._record_memory_history(None)
        assert torch.cuda.memory._snapshot()["device_traces"][0] == []
        print("history ok")
    """)


def test_a_blocks_stacks_are_never_shown_for_a_later_block_at_its_address():
    """A block recorded with stacks and freed after history went off takes its stacks with
    it: a block later made at the same address, recorded with no stacks, shows none (Note
    [Kept block stacks]); one still live keeps its stacks after history goes off, as in
    PyTorch."""
    run("""
        import json
        def recorded_with_stacks():
            return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        def frames_of(snap, address):
            for seg in snap["segments"]:
                for b in seg["blocks"]:
                    if b["address"] == address and b["state"] == "active_allocated":
                        return json.dumps(b.get("frames", []))
            raise AssertionError(f"no live block at {address:#x}")
        torch.cuda.memory._record_memory_history("all", context="all", stacks="python")
        x = recorded_with_stacks()
        kept = recorded_with_stacks()
        torch.cuda.memory._record_memory_history(None)
        address = x.data_ptr()
        assert "recorded_with_stacks" in frames_of(torch.cuda.memory._snapshot(), kept.data_ptr())
        del x                                      # freed while history is off
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python")
        y = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert y.data_ptr() == address, (hex(y.data_ptr()), hex(address))
        text = frames_of(torch.cuda.memory._snapshot(), address)
        assert "recorded_with_stacks" not in text, text
        torch.cuda.memory._record_memory_history(None)
        print("stacks ok")
    """)


def test_a_frees_trace_entries_carry_the_size_asked_for_and_the_blocks_stream():
    # As PyTorch's allocator records them: a free's entries have the alloc entry's size (so
    # that memory_viz's running total comes back to where it was), the block's stream, and,
    # with history of allocation stacks only, the block's allocation stacks.
    out = run("""
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = torch.empty(1000, dtype=torch.uint8, device="cuda")
        addr = x.data_ptr()
        del x
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        mine = [e for e in trace if e["addr"] == addr]
        alloc = [e for e in mine if e["action"] == "alloc"][-1]
        frees = [e for e in mine if e["action"] in ("free_requested", "free_completed")]
        assert len(frees) == 2, mine
        assert alloc["size"] == 1000 and all(e["size"] == 1000 for e in frees), mine
        assert alloc["stream"] == side.cuda_stream != 0, alloc
        assert all(e["stream"] == alloc["stream"] for e in frees), mine
        assert all(e["frames"] for e in frees), frees
        torch.cuda.memory._record_memory_history(None)
        print("sizes", [e["size"] for e in frees])
    """)
    assert "sizes [1000, 1000]" in out


def test_clearing_history_keeps_the_stacks_of_live_blocks_and_their_segments():
    # As PyTorch's allocator keeps a block's stacks on the block, and a segment's on its
    # first block: clear_history drops the trace, not what the snapshot shows of the tensors
    # that still live, nor each segment's "frames" (the stacks of the allocation that made
    # it, which memory_viz shows).
    out = run("""
        import json
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python")
        def make_the_tensor():
            return torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        x = make_the_tensor()
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                                 clear_history=True)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        mine = [b for s in snap["segments"] for b in s["blocks"]
                if b["address"] == x.data_ptr()]
        assert len(mine) == 1 and "make_the_tensor" in json.dumps(mine[0]), mine
        seg = [s for s in snap["segments"]
               if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
        assert len(seg) == 1 and "make_the_tensor" in json.dumps(seg[0].get("frames", [])), seg
        assert not [e for e in snap["device_traces"][0] if e["action"] == "alloc"], snap
        print("kept", len(mine[0]["frames"]))
    """)
    assert "kept" in out


def test_the_snapshot_is_in_address_order_and_leaves_a_snapshot_entry_in_the_trace():
    # As PyTorch's snapshot: a device's segments (its pool's and its graphs' and MemPools'
    # together) sorted by address, and, while history is on, a "snapshot" entry whose size
    # is the active bytes shown. PyTorch copies the trace before it records the entry, so
    # the entry shows in the next snapshot, and none ends the first one's trace.
    out = run("""
        torch.cuda.memory._record_memory_history()
        mp = torch.cuda.MemPool()
        xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 << 20)]
        with torch.cuda.use_mem_pool(mp):
            ys = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (5 << 20, 700)]
        xs.append(torch.empty(40 << 20, dtype=torch.uint8, device="cuda"))
        snap = torch.cuda.memory._snapshot()
        later = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        segs = [s for s in snap["segments"] if s["device"] == 0]
        addrs = [s["address"] for s in segs]
        assert addrs == sorted(addrs) and len(addrs) >= 3, addrs
        assert snap["device_traces"][0][-1]["action"] == "alloc", snap["device_traces"][0][-1]
        last = later["device_traces"][0][-1]
        assert last["action"] == "snapshot", last
        assert last["size"] == sum(s["active_size"] for s in segs), (last, segs)
        for s in segs:
            assert s["requested_size"] == sum(b["requested_size"] for b in s["blocks"]
                                              if b["state"] != "inactive"), s
        print("segments", len(addrs))
    """)
    assert "segments" in out


def test_history_of_state_only_puts_no_stacks_on_any_entry():
    # PyTorch's own test_memory_plots_free_stack: with context="state" the trace's entries
    # carry no stacks (a free's were its block's allocation stacks here), with "alloc" the
    # allocation's stacks and with "all" the free's too.
    out = run("""
        import json
        for context in ("alloc", "all", "state"):
            torch.cuda.memory.empty_cache()
            torch.cuda.memory._record_memory_history(context=context)
            x = None
            def thealloc():
                return torch.rand(3, 4, device="cuda")
            def thefree():
                global x
                del x
            x = thealloc()
            thefree()
            ss = json.dumps(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(None)
            assert ("thefree" in ss) == (context == "all"), context
            assert ("thealloc" in ss) == (context != "state"), context
        print("stacks by context ok")
    """)
    assert "stacks by context ok" in out


def test_skipped_actions_still_reach_the_trace_trackers():
    # As PyTorch's record_trace: skip_actions keeps entries out of the history only; the
    # trackers (NCCL's registration hook) still see every segment.
    build = f"SOURCE = {TRACKER_SOURCE!r}\n" + TRACKER_BUILD
    out = run("""
        torch.cuda.init()
        tracker.tracker_attach()
        torch.cuda.memory._record_memory_history(
            skip_actions=["segment_alloc", "segment_free", "segment_map", "segment_unmap"])
        a = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")   # a segment of its own
        ptr = a.data_ptr()
        del a
        torch.cuda.empty_cache()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(None)
        kept = {e["action"] for e in trace}
        assert "alloc" in kept and not any(k.startswith("segment") for k in kept), kept
        seen = tracked()
        grows = [e for e in seen if e[0] in ("segment_alloc", "segment_map")
                 and e[1] <= ptr < e[1] + e[2]]
        gives = [e for e in seen if e[0] in ("segment_free", "segment_unmap")]
        assert grows and gives, seen
        print("trackers saw", len(grows), len(gives))
    """, prelude=PRELUDE + build)
    assert "trackers saw" in out


def test_history_turned_off_drops_the_annotations():
    # As PyTorch's recordHistory: record_function marks of an earlier recording do not show
    # in the next one's snapshots.
    out = run("""
        torch.cuda.memory._record_memory_history(global_record_annotations=True)
        with torch.profiler.record_function("first-recording"):
            x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.memory._record_memory_history(None)
        torch.cuda.memory._record_memory_history(global_record_annotations=True)
        marks = torch.cuda.memory._snapshot()["external_annotations"]
        torch.cuda.memory._record_memory_history(None)
        assert "first-recording" not in [m.get("name") for m in marks], marks
        print("annotations dropped")
    """)
    assert "annotations dropped" in out
