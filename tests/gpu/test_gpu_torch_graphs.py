"""CUDA graphs and torch.compile under the pool: capture, replay, private pools, checkpoints and
stream reuse inside a capture.

The scripts use PyTorch's own API only, as a training or inference script would, and check
that the answers are the pool's (each in a fresh interpreter: tests/_torch_scripts.py)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import PRELUDE, GRAPH_OF_ONE_PRODUCT, run  # noqa: E402


def test_cuda_graph_capture_and_replay():
    run("""
        static_in = torch.randn(1024, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):          # warm up, as PyTorch's docs do
                out = (static_in * 2).sin()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = (static_in * 2).sin()
        for _ in range(3):
            static_in.copy_(torch.randn(1024, device="cuda"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.allclose(static_out, (static_in * 2).sin())
        # A second graph shares the first one's private pool.
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g.pool()):
            out2 = static_out + 1
        g2.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out2, static_out + 1)
        reserved = torch.cuda.memory_reserved()
        del g, g2, static_out, out2
        import gc; gc.collect()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() < reserved, (torch.cuda.memory_reserved(), reserved)
    """)


def test_empty_cache_keeps_a_live_graphs_pool_and_a_live_mempools_cache():
    """As under PyTorch's allocator (its test_graph_memory_stats_and_use_result_after_
    destroy_graph): empty_cache() leaves the private pool of a graph that still exists,
    whose free blocks are the capture's intermediates its replays write, and gives it back
    once the graph is gone. It emptied every private pool before, and the next replay
    faulted on freed memory (an illegal address)."""
    run("""
        import gc
        # Requests just over 10 MiB get segments of their own: the five intermediates of
        # the capture end up in two segments no live tensor holds.
        numel = (10 * 1024 * 1024 + 512) // 4
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            a = torch.ones(numel, device="cuda")
            before = torch.cuda.memory_stats()["segment.large_pool.current"]
            g = torch.cuda.CUDAGraph()
            g.capture_begin()
            b = a.clone()
            for _ in range(5):
                b = b.clone() + 1
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        captured = torch.cuda.memory_stats()["segment.large_pool.current"] - before
        assert captured == 3, captured      # PyTorch's own count for this capture
        for _ in range(2):
            g.replay()
            assert b.sum().item() == 6 * numel
            torch.cuda.empty_cache()
            kept = torch.cuda.memory_stats()["segment.large_pool.current"] - before
            assert kept == captured, (kept, captured)
        del g
        gc.collect()
        torch.cuda.empty_cache()
        assert b.sum().item() == 6 * numel   # the graph's output outlives the graph
        left = torch.cuda.memory_stats()["segment.large_pool.current"] - before
        assert left == 1, left               # b's segment; the idle two went back

        # A MemPool that still exists keeps its cache through empty_cache().
        mp = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(mp):
            x = torch.randn(4, device="cuda")
        del x
        torch.cuda.empty_cache()
        assert len(mp.snapshot()) == 1, mp.snapshot()
        print("ok")
    """)


def test_a_graphs_private_pool_takes_plain_segments():
    """A graph's private pool takes its segments from cuMemAlloc, not from the cudaMemPool
    whose chunk the device pool's segments are rounded to (Note [Segment rounding]): there a
    rounding would only make the graph hold more, 32 MiB for one small tensor."""
    run("""
        MiB = 1 << 20
        assert pool.options["segment_rounding"] and pool.options["segment_rounding"] > 2 * MiB
        x = torch.ones(256, device="cuda")     # the device pool's segments, outside the graph
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2                           # 1 KiB: a small segment of the graph's pool
            z = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
            z.fill_(1)                          # 12 MiB: a large one of its own size
        g.replay()
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before
        assert grown == 2 * MiB + 12 * MiB, grown / MiB
        assert torch.equal(y, x * 2) and int(z.sum()) == 12 * MiB
    """)


GRAPH_PEAK_SCRIPT = """
MiB = 1 << 20
torch.cuda.init()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
a = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
del a
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):          # its output stays in the graph's private pool
    out = torch.empty(50 * MiB, dtype=torch.uint8, device="cuda")
    out.fill_(1)
g.replay()
b = torch.empty(180 * MiB, dtype=torch.uint8, device="cuda")
del b
torch.cuda.synchronize()
print("peak", torch.cuda.max_memory_allocated() - base)
print("now", torch.cuda.memory_allocated() - base)
"""


def test_peak_with_a_cuda_graph_is_the_devices_as_pytorchs():
    """Note [Device peaks]: max_memory_allocated counts a graph's private pool with the
    device's, at the moment the two together peaked, as PyTorch's own allocator does: 230
    MiB here (180 beside the graph's 50), where the two pools' peaks summed are 250."""
    def figures(out):
        return {line.split()[0]: int(line.split()[1]) for line in out.splitlines()
                if line.startswith(("peak ", "now "))}

    native = subprocess.run([sys.executable, "-c", "import torch\n" + GRAPH_PEAK_SCRIPT],
                            capture_output=True, text=True, timeout=300)
    assert native.returncode == 0, native.stderr
    ours = figures(run(GRAPH_PEAK_SCRIPT))
    theirs = figures(native.stdout)
    assert ours == theirs, (ours, theirs)
    assert ours["peak"] < 250 << 20


def test_torch_compile_reduce_overhead():
    run("""
        def f(x, w):
            return torch.nn.functional.gelu(x @ w).sum(dim=-1)
        cf = torch.compile(f, mode="reduce-overhead")
        w = torch.randn(256, 256, device="cuda")
        for step in range(6):
            x = torch.randn(64, 256, device="cuda")
            y = cf(x, w)
            torch.testing.assert_close(y, f(x, w), rtol=1e-3, atol=1e-3)
        print("compiled ok")
    """, timeout=600)


@pytest.mark.parametrize("streams", [2, 4])
def test_graph_capture_record_stream_reuse_reclaims_within_the_capture(streams):
    # Note [Capture reuse]: PyTorch's graph_capture_record_stream_reuse, set at run time as
    # its own tests and CUDA-graph training recipes do. A block read on side streams is
    # not reused before they join the capturing stream, and is reused after.
    out = run(f"""
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
        assert pool.options["graph_capture_record_stream_reuse"] is True
        main = torch.cuda.Stream()
        sides = [torch.cuda.Stream() for _ in range({streams} - 1)]
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.stream(main):
            g.capture_begin()
            sink = torch.empty(1024, device="cuda")
            data1 = torch.ones(1024, device="cuda")
            data1_ptr = data1.data_ptr()
            outs = []
            for side in sides:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    outs.append(data1 * 3)
                    data1.record_stream(side)
            del data1
            data2 = torch.empty(1024, device="cuda")        # the sides have not joined
            for side in sides:
                main.wait_stream(side)
            sink.fill_(1.0)
            data3 = torch.empty(1024, device="cuda")        # they have now
            data3.fill_(5.0)
            g.capture_end()
        torch.cuda.synchronize()
        assert data2.data_ptr() != data1_ptr, "reused before the streams joined"
        assert data3.data_ptr() == data1_ptr, (data3.data_ptr(), data1_ptr)
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            assert all(bool((o == 3).all()) for o in outs)
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")
        assert pool.options["graph_capture_record_stream_reuse"] is False
        print("reclaimed", data3.data_ptr() == data1_ptr)
    """)
    assert "reclaimed True" in out


def test_a_checkpoint_restore_records_the_blocks_it_puts_back():
    # A block a restore allocates again is an allocation to history as in PyTorch's restore
    # (before, history showed nothing of it). No tensor claims it here: PyTorch keeps such a
    # block allocated for its cudagraph trees, and the pool's live blocks say so.
    out = run("""
        addr = y.untyped_storage().data_ptr()
        assert torch._C._cuda_checkPoolLiveAllocations(0, graph_pool, {addr})
        state = torch._C._cuda_getCheckpointState(0, graph_pool)
        del y
        assert torch._C._cuda_checkPoolLiveAllocations(0, graph_pool, set())
        torch.cuda.memory._record_memory_history()
        torch._C._cuda_setCheckpointPoolState(0, state, [], [])
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(None)
        mine = [e["action"] for e in trace if e["addr"] == addr]
        assert mine == ["alloc"], mine
        assert torch._C._cuda_checkPoolLiveAllocations(0, graph_pool, {addr})
        print("restored", mine)
    """, prelude=PRELUDE + GRAPH_OF_ONE_PRODUCT)
    assert "restored" in out


def test_a_released_graphs_counts_stay_in_memory_stats():
    # PyTorch keeps one set of counters per device: a graph's pool going away frees what it
    # held, and its cumulative counts (allocations made, segments allocated) stay. They went
    # down here when the graph's pool went.
    out = run("""
        import gc
        before = torch.cuda.memory_stats()
        del g, y
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_stats()
        for key in ("allocation.all.allocated", "segment.all.allocated",
                    "allocated_bytes.all.allocated", "num_device_alloc"):
            assert after[key] >= before[key], (key, before[key], after[key])
        assert after["segment.all.freed"] > before["segment.all.freed"], (before, after)
        assert after["segment.all.current"] < before["segment.all.current"], (before, after)
        torch.cuda.reset_accumulated_memory_stats()   # and they go with the device's
        again = torch.cuda.memory_stats()
        assert again["segment.all.allocated"] == again["segment.all.freed"] == 0, again
        print("counts kept")
    """, prelude=PRELUDE + GRAPH_OF_ONE_PRODUCT)
    assert "counts kept" in out
