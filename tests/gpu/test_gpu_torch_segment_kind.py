"""PyTorch's expandable_segments switched while a program runs, under the pool (Note [Segment
kind at run time] in mempool/_csrc/glue/mp_torch_private.c): later segments are of the new
kind, earlier blocks stay where they are, and the device's figures, snapshots, caches and
out-of-memory path cover both kinds, as under PyTorch's own allocator.

The scripts use PyTorch's own API only, each in a fresh interpreter (tests/_torch_scripts.py).
"""
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import PRELUDE, FRACTION_256_MIB_ABOVE_NOW, counting_allocator, run  # noqa: E402


def test_pytorchs_mempool_expandable_case(tmp_path):
    # PyTorch's TestMemPool.test_mempool_expandable, with a pluggable allocator of its own
    # for the MemPool: one segment from the MemPool's allocator, one expandable segment
    # for the tensor made outside it after the switch.
    lib = counting_allocator(tmp_path)
    out = run(f"""
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        mine = torch.cuda.memory.CUDAPluggableAllocator({str(lib)!r}, "counting_alloc",
                                                        "counting_free")
        mp = torch.cuda.MemPool(mine.allocator())
        nelem = 1024 * 1024 // 4
        data = []
        with torch.cuda.use_mem_pool(mp):
            data.append(torch.empty(nelem, device="cuda"))
        data.append(torch.empty(nelem, device="cuda"))
        segments = torch.cuda.memory.memory_snapshot()
        assert len(segments) == 2, segments
        assert sum(1 for s in segments if s["is_expandable"]) == 1, segments
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        print("two kinds")
    """)
    assert "two kinds" in out


def test_switching_both_ways_keeps_the_devices_figures():
    out = run("""
        import warnings
        warnings.simplefilter("error", RuntimeWarning)   # the switch says nothing
        MiB = 1 << 20
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        a = torch.ones(32 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        b = torch.ones(32 * MiB, dtype=torch.uint8, device="cuda")
        assert pool.used_bytes() == 32 * MiB                # b only: a is the companion's
        assert torch.cuda.memory_allocated() == 64 * MiB
        assert torch.cuda.memory_stats()["allocation.all.current"] == 2
        segs = torch.cuda.memory_snapshot()
        assert {s["is_expandable"] for s in segs} == {True, False}, segs
        assert all(s["segment_pool_id"] == (0, 0) for s in segs), segs
        assert torch.cuda.memory_reserved() >= 64 * MiB
        assert int(a.sum()) == 32 * MiB and int(b.sum()) == 32 * MiB
        del a                                              # freed into the companion
        torch.cuda.empty_cache()                           # which gives its pages back
        assert torch.cuda.memory_reserved() == pool.reserved_bytes()
        assert torch.cuda.memory_allocated() == 32 * MiB
        # A companion's block on another stream, and a graph captured while switched (the
        # graph's own pool takes its allocations, as in PyTorch).
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        s = torch.cuda.Stream()
        c = torch.ones(MiB, device="cuda")
        with torch.cuda.stream(s):
            d = c * 2
        c.record_stream(s)
        del c
        x = torch.ones(1 << 18, device="cuda")
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            y = x * 2
        g.replay()
        torch.cuda.synchronize()
        assert int(y.sum()) == 2 * (1 << 18) and int(d.sum()) == 2 * MiB
        del g, y
        # Peaks and the summary cover the companion's memory.
        torch.cuda.reset_peak_memory_stats()
        e = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated() >= 64 * MiB
        assert "Allocated memory" in torch.cuda.memory_summary()
        del d, e, x, b
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() == 0
        print("both ways")
    """)
    assert "both ways" in out


def test_one_kinds_cache_makes_room_for_the_other_under_a_fraction():
    # The companion cannot reuse the device pool's segments: before a request fails, the
    # other kind's cache goes back, as PyTorch's allocator frees all its cached segments.
    out = run("""
        MiB = 1 << 20
        start = torch.cuda.memory_allocated()              # the prelude's first tensor
        t = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        del t                                              # cached in the fixed segments
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        u = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_reserved() <= base + 256 * MiB
        del u                                              # cached in the companion
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        v = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_stats()["num_alloc_retries"] >= 2
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        w = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")   # the companion's
        try:
            torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            message = str(exc)
        else:
            raise AssertionError("400 MiB under a 256 MiB fraction was served")
        assert message.startswith("CUDA out of memory. Tried to allocate 400.00 MiB"), message
        assert "private pool" not in message, message
        # PyTorch's figures are the device's, both kinds together: v's and w's.
        allocated = torch.cuda.memory_allocated() - start
        assert allocated == 220 * MiB, allocated
        assert "Of the allocated memory 220.00 MiB is allocated by PyTorch" in message, message
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        print("room made")
    """, prelude=PRELUDE + FRACTION_256_MIB_ABOVE_NOW)
    assert "room made" in out
