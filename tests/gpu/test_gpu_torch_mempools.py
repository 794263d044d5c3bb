"""PyTorch's MemPool under the pool: allocators of its own, pool contexts, no_split, released
pools and unknown ids.

The scripts use PyTorch's own API only, as a training or inference script would, and check
that the answers are the pool's (each in a fresh interpreter: tests/_torch_scripts.py)."""

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import counting_allocator, run  # noqa: E402




def test_a_mempool_with_its_own_allocator_caches_its_segments(tmp_path):
    # Note [Custom segment sources]: as PyTorch's allocator, the MemPool keeps what its
    # allocator gave: a freed tensor's memory serves the next request there, and the
    # allocator's free comes only when the MemPool is gone and the cache emptied.
    lib = counting_allocator(tmp_path)
    out = run(f"""
        import ctypes, gc
        counts = ctypes.CDLL({str(lib)!r})
        mine = torch.cuda.memory.CUDAPluggableAllocator({str(lib)!r}, "counting_alloc",
                                                        "counting_free")
        mp = torch.cuda.MemPool(mine.allocator())
        with torch.cuda.use_mem_pool(mp):
            a = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
            a.fill_(1)
        a_ptr, n = a.data_ptr(), counts.counting_allocs()
        assert n >= 1
        reserved = torch.cuda.memory_reserved()
        assert reserved >= 40 << 20, reserved          # the MemPool's segments count
        del a
        with torch.cuda.use_mem_pool(mp):
            b = torch.empty(30 << 20, dtype=torch.uint8, device="cuda")
            b.fill_(2)
        torch.cuda.synchronize()
        assert b.data_ptr() == a_ptr, (b.data_ptr(), a_ptr)
        assert (counts.counting_allocs(), counts.counting_frees()) == (n, 0)
        assert int(b.sum()) == 2 * (30 << 20)
        del b
        torch.cuda.empty_cache()                        # a live MemPool keeps its cache
        assert counts.counting_frees() == 0
        del mp
        gc.collect()
        torch.cuda.empty_cache()
        assert counts.counting_frees() == n, (counts.counting_frees(), n)
        print("cached", n)
    """)
    assert "cached" in out


def test_the_newest_pool_context_takes_the_allocation_as_in_pytorch():
    # PyTorch searches its routes newest first: an inner use_mem_pool wins over an outer
    # one, and a graph captured inside a use_mem_pool context allocates to the graph's own
    # pool. Were the MemPool to take the graph's intermediates, its later tensors would
    # reuse memory the graph's replays write into.
    out = run("""
        def live(mp):
            return {b["address"] for seg in mp.snapshot() for b in seg["blocks"]
                    if b["state"] == "active_allocated"}
        outer, inner = torch.cuda.MemPool(), torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(outer):
            with torch.cuda.use_mem_pool(inner):
                x = torch.empty(1 << 20, device="cuda")
            y = torch.empty(1 << 20, device="cuda")
        assert x.data_ptr() in live(inner) and x.data_ptr() not in live(outer)
        assert y.data_ptr() in live(outer)

        mp = torch.cuda.MemPool()
        src = torch.ones(1 << 20, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.use_mem_pool(mp):
            with torch.cuda.stream(s):
                (src * 2).sum()          # warm up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                tmp = src * 3            # freed inside the capture: the graph's memory
                result = tmp.sum()
                del tmp
        assert result.data_ptr() not in live(mp), "the graph's output went to the MemPool"
        with torch.cuda.use_mem_pool(mp):
            later = torch.full((1 << 20,), 7.0, device="cuda")   # must not land in the graph's memory
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert result.item() == 3 * (1 << 20)
            assert bool((later == 7.0).all())
        print("routed")
    """)
    assert "routed" in out


def test_a_no_split_mempool_gives_each_tensor_a_segment_of_its_own():
    # MemPool(no_split=True) (Note [No split]): every tensor starts a segment; a plain
    # MemPool puts small tensors side by side in one.
    out = run("""
        import inspect
        if "no_split" not in inspect.signature(torch.cuda.MemPool.__init__).parameters:
            print("no no_split in this PyTorch")
            raise SystemExit(0)
        def segments(mp):
            return sorted((seg["address"], [b["address"] for b in seg["blocks"]
                                            if b["state"] == "active_allocated"])
                          for seg in mp.snapshot())
        whole, plain = torch.cuda.MemPool(no_split=True), torch.cuda.MemPool()
        tensors = {}
        for name, mp in (("whole", whole), ("plain", plain)):
            with torch.cuda.use_mem_pool(mp):
                tensors[name] = [torch.ones(256, device="cuda") for _ in range(3)]
        w, p = segments(whole), segments(plain)
        assert len(w) == 3 and all(len(blocks) == 1 and blocks[0] == addr
                                   for addr, blocks in w), w
        assert len(p) == 1 and len(p[0][1]) == 3, p
        assert sum(t.sum().item() for t in tensors["whole"]) == 3 * 256
        print("whole", len(w))
    """)
    if "no no_split" in out:
        pytest.skip("this PyTorch's MemPool takes no no_split")
    assert "whole 3" in out


def test_a_released_mempools_segments_leave_the_history_with_a_segment_free():
    # Note [Segment events at destroy]: the segments a MemPool still caches when it goes
    # are freed with it; memory history (and NCCL's registration, a trace tracker) must see
    # each go, at its address.
    out = run("""
        import gc
        torch.cuda.memory._record_memory_history(max_entries=100000)
        mp = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(mp):
            x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        seg = [s["address"] for s in mp.snapshot()]
        assert len(seg) == 1, seg
        del x, mp
        gc.collect()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        actions = [(e["action"], e["addr"]) for e in trace if e["action"].startswith("segment")]
        assert ("segment_alloc", seg[0]) in actions, actions
        assert ("segment_free", seg[0]) in actions, actions
        torch.cuda.memory._record_memory_history(None)
        print("freed", hex(seg[0]))
    """)
    assert "freed" in out


def test_asking_after_a_pool_id_nobody_has_is_an_error():
    # PyTorch's allocator refuses both (cudagraph trees call them); an unknown id answered
    # as an empty pool matched any empty set of live allocations.
    out = run("""
        torch.cuda.init()
        unknown = (987654, 0)
        for name, call in (
                ("checkPoolLiveAllocations",
                 lambda: torch._C._cuda_checkPoolLiveAllocations(0, unknown, set())),
                ("getCheckpointState",
                 lambda: torch._C._cuda_getCheckpointState(0, unknown))):
            try:
                call()
            except RuntimeError as exc:
                assert "Could not find pool of id" in str(exc) and name in str(exc), exc
            else:
                raise AssertionError(name + " answered for a pool nobody has")
        print("refused both")
    """)
    assert "refused both" in out
