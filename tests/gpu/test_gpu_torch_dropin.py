"""The calls real PyTorch scripts make, under ``mempool.torch.install`` (the full allocator).

Each case runs in a fresh interpreter: install() must come before PyTorch initialises CUDA,
and a broken capture or a crash must cost only its own case. The scripts use PyTorch's own
API only, as a training or inference script would, and check that the answers are the
pool's.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

PRELUDE = """
import torch, mempool, mempool.torch as mt
pool = mempool.Pool(backend="cuda", device=0)
glue = mt.install(pool, allocator="full")
assert isinstance(glue, mt.Glue), glue
assert torch.cuda.memory.get_allocator_backend() == "mempool"
"""

# The memory fraction set to 256 MiB above what the allocator holds (base) after a first
# tensor; total is the device's memory.
FRACTION_256_MIB_ABOVE_NOW = """
x = torch.empty(1, device="cuda")
torch.cuda.empty_cache()
total = torch.cuda.mem_get_info()[1]
base = torch.cuda.memory_reserved()
torch.cuda.set_per_process_memory_fraction((base + (256 << 20)) / total)
"""

# A CUDA graph g of one product, y = x * 2, captured into the private pool graph_pool.
GRAPH_OF_ONE_PRODUCT = """
x = torch.ones(1 << 18, device="cuda")
graph_pool = torch.cuda.graph_pool_handle()
g = torch.cuda.CUDAGraph()
torch.cuda.synchronize()
with torch.cuda.graph(g, pool=graph_pool):
    y = x * 2
"""


def run(body, timeout=300, prelude=PRELUDE):
    code = prelude + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, cwd=os.getcwd())
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_memory_statistics_report_the_pool():
    out = run("""
        x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        s = pool.stats()
        assert torch.cuda.memory_allocated() == s["allocated_bytes.all.current"] >= 8 << 20
        assert torch.cuda.memory_reserved() == pool.reserved_bytes()
        peak = torch.cuda.max_memory_allocated()
        y = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        assert torch.cuda.max_memory_allocated() >= peak + (32 << 20)
        del y
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
        stats = torch.cuda.memory_stats()
        for key in ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
                    "active_bytes.small_pool.allocated", "num_ooms", "num_alloc_retries",
                    "requested_bytes.all.current", "segment.all.current"):
            assert key in stats, key
        summary = torch.cuda.memory_summary()
        assert "Allocated memory" in summary and "GPU reserved memory" in summary
        free, total = torch.cuda.mem_get_info()
        assert 0 < free <= total
        print("allocated", torch.cuda.memory_allocated())
    """)
    assert "allocated" in out


def test_cudnn_benchmark_conv_training():
    run("""
        torch.backends.cudnn.benchmark = True
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.Flatten(),
                                  torch.nn.Linear(32 * 32 * 32, 10)).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for _ in range(3):
            x = torch.randn(16, 3, 32, 32, device="cuda")
            loss = net(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        assert torch.isfinite(loss).item()
        largest = torch.cuda.memory.caching_allocator_alloc  # the module still imports
    """)


def test_out_of_memory_is_torch_out_of_memory_error_and_training_goes_on():
    run("""
        x = torch.ones(1 << 20, device="cuda")
        before = pool.used_bytes()
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            msg = str(exc)
            assert "mempool" in msg and "Tried to allocate" in msg, msg
            # PyTorch's own words first: Hugging Face Accelerate's batch-size finder looks
            # for "CUDA out of memory." in the only argument of a RuntimeError, and PyTorch's
            # tests for "Tried to allocate X. GPU 0 has a total capacity of".
            assert isinstance(exc, RuntimeError) and len(exc.args) == 1
            assert "CUDA out of memory." in exc.args[0], msg
            assert msg.startswith("CUDA out of memory. Tried to allocate 1048576.00 GiB. GPU 0 "
                                  "has a total capacity of "), msg
        else:
            raise AssertionError("no OutOfMemoryError")
        try:
            torch.empty(1 << 62, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            assert "CUDA out of memory. Tried to allocate more than 1EB memory." in str(exc)
        else:
            raise AssertionError("no OutOfMemoryError at 4 EiB")
        assert pool.used_bytes() == before
        pool.check_invariants()
        assert torch.cuda.memory_stats()["num_ooms"] >= 1
        y = (x * 2).sum().item()
        assert y == 2 * (1 << 20)
    """)


def test_oom_observer_is_called():
    run("""
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        assert len(seen) == 1 and seen[0][0] == 0, seen
        # PyTorch's arguments: device, the size asked for, the device's total (no fraction
        # set), its free bytes.
        free, total = torch.cuda.mem_get_info()
        device, asked, allowed, free_then = seen[0]
        assert asked == 1 << 50 and allowed == total, seen
        assert 0 < free_then <= total, seen
    """)


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


TRACKER_SOURCE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
namespace {
std::mutex mu;
std::string seen;   // one line per entry: action address size, and for a segment_free the
                    // device's free bytes as the tracker heard of it (else 0)
const char* name(c10::CachingDeviceAllocator::TraceEntry::Action a) {
  using E = c10::CachingDeviceAllocator::TraceEntry;
  switch (a) {
    case E::ALLOC: return "alloc";
    case E::FREE_REQUESTED: return "free_requested";
    case E::FREE_COMPLETED: return "free_completed";
    case E::SEGMENT_ALLOC: return "segment_alloc";
    case E::SEGMENT_FREE: return "segment_free";
    case E::SEGMENT_MAP: return "segment_map";
    case E::SEGMENT_UNMAP: return "segment_unmap";
    default: return "other";
  }
}
}  // namespace
extern "C" void tracker_attach() {
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::CachingDeviceAllocator::TraceEntry& te) {
        size_t free_bytes = 0, total = 0;
        if (te.action_ == c10::CachingDeviceAllocator::TraceEntry::SEGMENT_FREE &&
            cudaMemGetInfo(&free_bytes, &total) != cudaSuccess)
          free_bytes = 0;
        std::lock_guard<std::mutex> lock(mu);
        seen += std::string(name(te.action_)) + " " + std::to_string(te.addr_) + " " +
                std::to_string(te.size_) + " " + std::to_string(free_bytes) + "\n";
      });
}
extern "C" void tracker_attach_refusing() {   // throws at every segment_free
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::CachingDeviceAllocator::TraceEntry& te) {
        if (te.action_ == c10::CachingDeviceAllocator::TraceEntry::SEGMENT_FREE)
          throw std::runtime_error("the tracker refused a segment_free");
      });
}
extern "C" size_t tracker_entries(char* out, size_t n) {   // the length; copied when it fits
  std::lock_guard<std::mutex> lock(mu);
  if (seen.size() < n) std::memcpy(out, seen.c_str(), seen.size() + 1);
  return seen.size();
}
"""

# SOURCE (C++ against the installed PyTorch's headers, with the glue's own toolchain) built
# and loaded as `built`.
CPP_BUILD = """
import ctypes, os, subprocess, tempfile
from mempool import torch_build as tb
src = os.path.join(tempfile.mkdtemp(), "built.cpp")
with open(src, "w") as f:
    f.write(SOURCE)
includes, libdir = tb._torch_paths(torch)
lib = src[:-4] + ".so"
subprocess.run([tb._compiler(), "-std=c++17", "-O1", "-shared", "-fPIC",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                *(f"-I{d}" for d in includes + tb._cuda_include_dirs(torch)), src,
                f"-L{libdir}", "-lc10", "-lc10_cuda", "-o", lib], check=True)
built = ctypes.CDLL(lib)
"""

TRACKER_BUILD = CPP_BUILD + """
tracker = built
tracker.tracker_entries.restype = ctypes.c_size_t

def tracked():
    n = tracker.tracker_entries(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    tracker.tracker_entries(buf, n + 1)
    return [(a, int(p), int(z), int(f)) for a, p, z, f in
            (line.split() for line in buf.value.decode().splitlines())]
"""


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


def test_runtime_allocator_settings_act_on_the_pool():
    """torch.cuda.memory._set_allocator_settings reaches PyTorch as before (its pinned-memory
    keys act), the rounding and split keys change the pool as they would PyTorch's allocator
    (memory_stats sees each tensor's block rounded as PyTorch's own test_allocator_settings
    expects), and expandable_segments, which cannot switch a pool, warns once."""
    run("""
        import warnings
        warnings.simplefilter("ignore", FutureWarning)   # 2.11 points to the binding below
        torch.cuda.init()        # memory_stats() is {} until CUDA is initialised
        key = "active_bytes.all.allocated"
        nbytes = 4 * 21 * 1024 * 1024
        def grown_by(settings):
            torch.cuda.memory._set_allocator_settings(settings)
            torch.cuda.empty_cache()
            start = torch.cuda.memory_stats()[key]
            t = torch.rand(nbytes // 4, device="cuda")
            return torch.cuda.memory_stats()[key] - start, t
        assert grown_by("")[0] == nbytes
        assert grown_by("roundup_power2_divisions:4")[0] == 96 << 20
        assert grown_by("roundup_power2_divisions:[64:8,>:1]")[0] == 88 << 20
        assert grown_by("garbage_collection_threshold:0.5,max_split_size_mb:40")[0] == nbytes
        assert pool.options["max_split_size"] == 40 << 20
        if hasattr(torch._C, "_accelerator_setAllocatorSettings"):   # the newer entry point
            torch._C._accelerator_setAllocatorSettings("roundup_power2_divisions:4")
            assert pool.options["roundup_power2_divisions"] == [4] * 16
            torch._C._accelerator_setAllocatorSettings("max_split_size_mb:40")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            torch.cuda.memory._set_allocator_settings("pinned_use_background_threads:True")
        said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
        assert len(said) == 1 and "cannot switch the pool on device 0" in said[0], said
        assert pool.options["expandable_segments"] is False
        assert pool.options["max_split_size"] is None        # each call sets all three
        x = torch.ones(1 << 20, device="cuda")
        assert torch.cuda.memory_allocated() == pool.stats()["allocated_bytes.all.current"]
    """)


def test_torch_accelerator_memory_functions_report_the_pool():
    """torch.accelerator's device-generic memory functions ask c10's allocator registry for
    the CUDA allocator, where PyTorch registers its own caching allocator: install registers
    the pool's above it, so they report the pool, as torch.cuda's do."""
    run("""
        acc = torch.accelerator
        if not hasattr(acc, "memory_stats"):
            print("no torch.accelerator memory functions in", torch.__version__)
            raise SystemExit(0)
        x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        s = pool.stats()
        assert acc.memory_allocated() == s["allocated_bytes.all.current"] >= 8 << 20
        assert acc.memory_reserved() == pool.reserved_bytes()
        assert acc.memory_stats()["active_bytes.all.current"] == s["active_bytes.all.current"]
        del x
        acc.empty_cache()
        assert pool.reserved_bytes() == 0, pool.reserved_bytes()
        acc.reset_peak_memory_stats()
        assert acc.max_memory_allocated() == acc.memory_allocated() == 0
        print("accelerator ok")
    """)


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


def test_the_fraction_refuses_what_pytorchs_does_after_runtime_settings():
    """PyTorch's own test_max_split_expandable: the memory fraction leaves room for 120 MiB
    over what is reserved, settings change between allocations, and a fourth 40 MiB is
    refused; all of it freed, 120 MiB then fits."""
    run("""
        import warnings
        warnings.simplefilter("ignore")   # expandable_segments differs from the pool's: warned
        mb = 1 << 20
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info()[1]
        pre = torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction((120 * mb + pre) / total)
        alloc = lambda n: torch.ones(n * mb, dtype=torch.int8, device="cuda")
        torch.cuda.memory._set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
        a = alloc(40)
        torch.cuda.memory._set_allocator_settings("expandable_segments:True,max_split_size_mb:40")
        b = alloc(40)
        torch.cuda.memory._set_allocator_settings("expandable_segments:False,max_split_size_mb:40")
        c = alloc(40)
        try:
            alloc(40)
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError(f"a fourth 40 MiB fitted: reserved {torch.cuda.memory_reserved()}, "
                                 f"{pre} before, fraction {torch.cuda.get_per_process_memory_fraction()}")
        del a, b, c
        alloc(120)
        torch.cuda.set_per_process_memory_fraction(1.0)
        print("fraction ok")
    """)


def test_caching_off_allocates_from_the_driver_outside_the_pool():
    """torch.cuda.caching_allocator_enable(False), as on PyTorch's allocator: each request is
    the driver's cudaMalloc, outside the pool and its statistics, freed by cudaFree whenever
    it dies, caching back on or not (Note [Caching off])."""
    run("""
        torch.cuda.empty_cache()
        stats = lambda: torch.cuda.memory_stats()["requested_bytes.all.allocated"]
        stream = torch.cuda.current_stream().cuda_stream
        before, reserved = stats(), torch.cuda.memory_reserved()
        torch.cuda.caching_allocator_enable(False)
        x = torch.ones(1 << 20, device="cuda")                  # 4 MiB of the driver's
        raw = torch._C._cuda_cudaCachingAllocator_raw_alloc(1 << 20, stream)
        assert stats() == before and torch.cuda.memory_reserved() == reserved
        try:
            torch.empty(1 << 48, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            assert "caching is off" in str(e), str(e)
        else:
            raise AssertionError("256 TiB fitted")
        torch.cuda.caching_allocator_enable(True)
        y = torch.ones(1 << 20, device="cuda")                  # the pool's again
        assert stats() == before + (4 << 20), (stats(), before)
        torch._C._cuda_cudaCachingAllocator_raw_delete(raw)     # the driver's, caching on
        assert float(x.sum()) == 1 << 20
        torch.cuda.synchronize()
        free_before, counted = torch.cuda.mem_get_info()[0], torch.cuda.memory_stats()
        del x                                                   # cudaFree
        assert torch.cuda.mem_get_info()[0] >= free_before + (2 << 20)   # the driver has it back
        after = torch.cuda.memory_stats()                       # and the pool saw nothing
        for key in ("requested_bytes.all.freed", "allocated_bytes.all.current", "reserved_bytes.all.current"):
            assert after[key] == counted[key], (key, after[key], counted[key])
        print("caching off ok")
    """)


def test_the_profiler_sees_the_pools_allocations():
    """torch.profiler.profile(profile_memory=True) hears of each allocation and free, as from
    PyTorch's allocator (its memory timeline and _memory_viz's profile_plot read them)."""
    run("""
        import json
        from torch.cuda._memory_viz import _profile_to_snapshot
        def profiled_allocation():
            x = torch.rand(128, 128, device="cuda")
            return (x * x + x * x).sum()
        with torch.profiler.profile(with_stack=True, profile_memory=True,
                                    record_shapes=True) as prof:
            profiled_allocation()
        text = json.dumps(_profile_to_snapshot(prof))
        assert "profiled_allocation" in text, text[:2000]
        cuda_mem = sum(getattr(e, "device_memory_usage", 0) or getattr(e, "cuda_memory_usage", 0)
                       for e in prof.key_averages())
        print("profiler ok", len(text), cuda_mem)
    """)


def test_the_memory_fraction_caps_mempools_too():
    """As in PyTorch, set_per_process_memory_fraction caps everything the allocator holds on
    the device: a MemPool's (private) segments count against it with the device pool's
    (Note [Shared limit])."""
    run("""
        mp = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(mp):
            a = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
        try:
            b = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("the MemPool's 200 MiB did not count against the fraction")
        c = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")   # what is left fits
        torch.cuda.set_per_process_memory_fraction(1.0)
        b = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
        print("fraction ok")
    """, prelude=PRELUDE + FRACTION_256_MIB_ABOVE_NOW)


def test_empty_cache_fraction_record_stream_and_mem_pool():
    run("""
        x = torch.randn(1 << 22, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = x * 2
        x.record_stream(s)
        del x, y
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        assert abs(torch.cuda.get_per_process_memory_fraction(0) - 0.25) < 1e-6
        try:
            torch.empty(int(pool.capacity * 0.3), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as exc:
            assert "limit" in str(exc), str(exc)
        else:
            raise AssertionError("the memory fraction did not cap the pool")
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        mp = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(mp):
            z = torch.ones(1 << 20, device="cuda")
        segs = mp.snapshot()
        assert any(seg["segment_pool_id"] == mp.id for seg in segs), segs
        assert z.sum().item() == 1 << 20
        del z
    """)


def test_ipc_export_is_refused_clearly():
    run("""
        x = torch.ones(16, device="cuda")
        try:
            x.untyped_storage()._share_cuda_()
        except RuntimeError as exc:
            assert "mempool" in str(exc) and "another process" in str(exc), str(exc)
        else:
            raise AssertionError("sharing was not refused")
    """)


def test_sharing_memory_the_pool_did_not_hand_out_is_an_invalid_device_pointer():
    # shareIpcHandle (what _share_cuda_ asks) and getBaseAllocation of CuPy's memory seen
    # through DLPack, where no block of the allocator starts: PyTorch's allocator raises
    # "invalid device pointer"; the pool named IPC instead of the pointer, and
    # getBaseAllocation returned the pointer as its own base.
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run("""
            import cupy
            foreign = torch.from_dlpack(cupy.ones(1 << 16, dtype=cupy.float32))
            try:
                foreign.untyped_storage()._share_cuda_()
            except RuntimeError as exc:
                assert "invalid device pointer" in str(exc), str(exc)
            else:
                raise AssertionError("a base allocation was found for CuPy's memory")
            print("refused as an invalid device pointer")
        """, prelude=prelude)
        assert "refused as an invalid device pointer" in out, out


PRODUCER = """
import base64, pickle, sys, torch
from torch.multiprocessing.reductions import reduce_tensor
x = torch.arange(4096, dtype=torch.float32, device="cuda") * 3
rebuild, args = reduce_tensor(x)     # what torch.multiprocessing sends for a CUDA tensor
torch.cuda.synchronize()
print(base64.b64encode(pickle.dumps((rebuild, args))).decode(), flush=True)
sys.stdin.readline()                 # keep the tensor alive until the receiver is done
"""


def test_receiving_a_cuda_tensor_from_a_process_on_pytorchs_allocator():
    """The receiving side of torch.multiprocessing under install: the sender runs PyTorch's
    own allocator and exports a legacy IPC handle; the glue opens it (getIpcDevPtr)."""
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        message = producer.stdout.readline().strip()
        assert message, "the sending process printed no handle"
        out = run(f"""
            import base64, pickle
            rebuild, args = pickle.loads(base64.b64decode({message!r}))
            y = rebuild(*args)
            assert y.device.type == "cuda" and y.shape == (4096,)
            expect = torch.arange(4096, dtype=torch.float32, device="cuda") * 3
            assert torch.equal(y, expect), "the received tensor's values differ"
            z = y * 2                        # and the pool serves the work done on it
            assert torch.cuda.memory_allocated() == pool.stats()["allocated_bytes.all.current"]
            print("received", float(z.sum()))
        """)
        assert "received" in out
    finally:
        producer.communicate("done\n", timeout=60)


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


# A pluggable allocator as NCCL's buffer registration brings one: the driver's own cuMemAlloc
# and cuMemFree, counted (loaded with dlopen, so that it builds with no CUDA headers).
COUNTING_ALLOCATOR = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef int (*mem_alloc_t)(unsigned long long *, size_t);
typedef int (*mem_free_t)(unsigned long long);
static mem_alloc_t mem_alloc;
static mem_free_t mem_free;
static int allocs, frees;
static void load(void) {
    if (mem_alloc) return;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    mem_alloc = (mem_alloc_t)dlsym(lib, "cuMemAlloc_v2");
    mem_free = (mem_free_t)dlsym(lib, "cuMemFree_v2");
}
void *counting_alloc(size_t size, int device, void *stream) {
    unsigned long long p = 0;
    load();
    if (mem_alloc(&p, size)) return 0;
    allocs++;
    return (void *)p;
}
void counting_free(void *ptr, size_t size, int device, void *stream) {
    load();
    mem_free((unsigned long long)ptr);
    frees++;
}
int counting_allocs(void) { return allocs; }
int counting_frees(void) { return frees; }
"""


def test_a_mempool_with_its_own_allocator_caches_its_segments(tmp_path):
    # Note [Custom segment sources]: as PyTorch's allocator, the MemPool keeps what its
    # allocator gave: a freed tensor's memory serves the next request there, and the
    # allocator's free comes only when the MemPool is gone and the cache emptied.
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the pluggable allocator")
    source, lib = tmp_path / "counting.c", tmp_path / "counting.so"
    source.write_text(COUNTING_ALLOCATOR)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(source), "-ldl"],
                   check=True)
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


def test_out_of_memory_takes_back_what_a_released_mempool_still_caches():
    # Note [Memory other pools hold at OOM]: a MemPool released while one of its tensors
    # lives keeps the blocks of its later frees; as PyTorch's allocator does, the device
    # pool's request that finds the fraction full takes them back before it raises.
    out = run("""
        import gc
        mp = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(mp):
            keep = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
            big = torch.empty(160 << 20, dtype=torch.uint8, device="cuda")
        del mp
        gc.collect()
        del big   # cached by a pool nobody can allocate from any more
        c = torch.empty(160 << 20, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_reserved() <= base + (256 << 20)
        stats = torch.cuda.memory_stats()   # as PyTorch counts it: a retry, not an OOM
        assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] >= 1, stats
        print("taken back", torch.cuda.memory_reserved() - base)
    """, prelude=PRELUDE + FRACTION_256_MIB_ABOVE_NOW)
    assert "taken back" in out


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


def test_a_use_on_oom_mempool_serves_what_the_device_pool_refused():
    # MemPool(use_on_oom=True): a request the device pool cannot serve takes the MemPool's
    # free block, and, as PyTorch counts it, that is no OOM; a request neither can serve
    # raises one OOM, counted once.
    out = run("""
        try:
            mp = torch.cuda.MemPool(use_on_oom=True)
        except TypeError:
            print("no use_on_oom")
            raise SystemExit(0)
        with torch.cuda.use_mem_pool(mp):
            t = torch.empty(160 << 20, dtype=torch.uint8, device="cuda")
        where = t.data_ptr()
        del t   # the MemPool keeps the block
        y = torch.empty(160 << 20, dtype=torch.uint8, device="cuda")
        assert y.data_ptr() == where, (hex(y.data_ptr()), hex(where))
        assert torch.cuda.memory_stats()["num_ooms"] == 0, torch.cuda.memory_stats()
        try:
            torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("200 MiB fitted under the fraction")
        assert torch.cuda.memory_stats()["num_ooms"] == 1, torch.cuda.memory_stats()
        print("served by the MemPool")
    """, prelude=PRELUDE + FRACTION_256_MIB_ABOVE_NOW)
    if "no use_on_oom" in out:
        pytest.skip("this PyTorch's MemPool has no use_on_oom")
    assert "served by the MemPool" in out


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


def test_the_profiler_marks_an_out_of_memory_error():
    # PyTorch's own test_oom_tracing: the chrome trace of a profiled OOM has an
    # "[OutOfMemory]" event.
    out = run("""
        import json, os, tempfile
        from torch.autograd.profiler import profile
        with profile(profile_memory=True, record_shapes=True) as prof:
            try:
                torch.empty(1024, 1024, 1024, 1024, dtype=torch.float32, device="cuda")
            except torch.OutOfMemoryError as exc:
                assert "Tried to allocate" in str(exc), exc
            else:
                raise AssertionError("4 TiB fitted")
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            names = [e.get("name") for e in json.load(f)["traceEvents"]]
        assert "[OutOfMemory]" in names, sorted(set(n for n in names if n))[:40]
        print("oom marked")
    """)
    assert "oom marked" in out


def test_no_caching_from_pytorchs_variable():
    # PYTORCH_NO_CUDA_MEMORY_CACHING=1 (what memcheck runs use) turns caching off from the
    # start, as on PyTorch's allocator: tensors are the driver's own, outside the pool.
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    code = PRELUDE + textwrap.dedent("""
        x = torch.ones(1 << 20, device="cuda")
        assert x.sum().item() == 1 << 20
        assert pool.stats()["allocation.all.current"] == 0, pool.stats()
        assert torch.cuda.memory_allocated() == 0
        print("uncached")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "uncached" in done.stdout


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


# PyTorch's own allocator, for the cases that check a scenario means under it what they
# check under the pool.
NATIVE_PRELUDE = """
import torch
"""


def test_the_gpu_trace_hears_each_block_handed_out_and_given_back():
    # PyTorch's test_cuda_trace.py (test_memory_allocation_callback and
    # test_memory_deallocation_callback), and raw_alloc's blocks, on the pool
    # (Note [GPU trace hooks] in torch_allocator.cpp).
    out = run("""
        import torch.cuda._gpu_trace as gpu_trace
        torch._C._activate_gpu_trace()
        handed, given = [], []
        gpu_trace.register_callback_for_memory_allocation(handed.append)
        gpu_trace.register_callback_for_memory_deallocation(given.append)
        t = torch.empty(10, 4, device="cuda")
        ptr = t.data_ptr()
        assert handed == [ptr], (handed, ptr)
        del t
        assert given == [ptr], (given, ptr)
        raw = torch.cuda.caching_allocator_alloc(4096)
        assert handed[-1] == raw and len(handed) == 2, (handed, raw)
        torch.cuda.caching_allocator_delete(raw)
        assert given[-1] == raw and len(given) == 2, (given, raw)
        print("trace heard", len(handed), len(given))
    """)
    assert "trace heard 2 2" in out


SANITIZED_REUSE = """
    # x is read on a side stream s (recorded), freed, and its block handed out again on the
    # current stream once s has finished. s.query() tells the host without telling the
    # sanitizer, so only the allocator's free and allocation tell it that y is not x.
    from torch.cuda._sanitizer import enable_cuda_sanitizer
    enable_cuda_sanitizer()
    s = torch.cuda.Stream()
    n = 1 << 20
    x = torch.ones(n, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        total = x.sum()
    x.record_stream(s)
    ptr = x.data_ptr()
    del x
    while not s.query():
        pass
    y = torch.zeros(n, device="cuda")
    assert y.data_ptr() == ptr, "the block was not handed out again: the case shows nothing"
    torch.cuda.current_stream().wait_stream(s)
    print("no race reported", float(total), float(y.sum()))
"""


def test_the_cuda_sanitizer_sees_a_block_handed_out_again_as_a_new_tensor():
    # torch.cuda._sanitizer (TORCH_CUDA_SANITIZER=1) keeps each address's accesses until the
    # allocator says the block was freed. Before the pool said so, y's first write was
    # reported as a race with s's read of x. The same script under PyTorch's own allocator
    # shows that the case is no race.
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run(SANITIZED_REUSE, prelude=prelude)
        assert "no race reported 1048576.0 0.0" in out, out


# A free-memory callback of an extension (CUDA IPC registers one the same way): it holds a
# block and gives it back when the allocator runs the callbacks.
FREE_MEMORY_CALLBACK_SOURCE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
namespace {
void* held = nullptr;
int runs = 0;
struct GiveBack : public c10::FreeMemoryCallback {
  bool Execute() override {
    runs++;
    if (!held) return false;
    c10::cuda::CUDACachingAllocator::raw_delete(held);
    held = nullptr;
    return true;
  }
};
}  // namespace
namespace c10 {   // the registry's macro names its registerer unqualified
REGISTER_FREE_MEMORY_CALLBACK("mempool_test_give_back", ::GiveBack);
}  // namespace c10
extern "C" int hold(size_t n) {
  held = c10::cuda::CUDACachingAllocator::raw_alloc(n);
  return held != nullptr;
}
extern "C" int runs_so_far() { return runs; }
"""


def test_the_free_memory_callbacks_run_before_an_allocation_fails():
    # Note [Free memory callbacks]: a block a callback holds serves a request that does not
    # fit beside it. PyTorch's own allocator
    # runs the callbacks on a miss of its cache, so the same script passes under it.
    build = f"SOURCE = {FREE_MEMORY_CALLBACK_SOURCE!r}\n" + CPP_BUILD
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run("""
            torch.cuda.init()
            assert built.hold(200 << 20)
            y = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")   # 400 MiB > 256
            assert built.runs_so_far() >= 1
            print("served after the callbacks ran", built.runs_so_far())
        """, prelude=prelude + build + FRACTION_256_MIB_ABOVE_NOW)
        assert "served after the callbacks ran" in out, out


def test_raw_delete_refuses_a_pointer_no_block_starts_at():
    # torch.cuda.caching_allocator_delete of a pointer into a live block, of an unknown one,
    # or of one freed already: PyTorch's allocator raises "invalid device pointer" and frees
    # nothing. The pool read a pointer into a block as a tagged one and freed the live block.
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run("""
            before = torch.cuda.memory_allocated()
            p = torch.cuda.caching_allocator_alloc(1 << 20)
            held = torch.cuda.memory_allocated()
            for bad in (p + 1, p + 256, p + 512, p + (1 << 19)):
                try:
                    torch.cuda.caching_allocator_delete(bad)
                except RuntimeError as e:
                    assert "invalid device pointer" in str(e), e
                else:
                    raise AssertionError(f"{bad - p} bytes into the block was taken")
                assert torch.cuda.memory_allocated() == held, (bad - p, held)
            torch.cuda.caching_allocator_delete(p)
            assert torch.cuda.memory_allocated() == before < held
            try:
                torch.cuda.caching_allocator_delete(p)
            except RuntimeError as e:
                assert "invalid device pointer" in str(e), e
            else:
                raise AssertionError("a second delete was taken")
            print("refused, nothing freed")
        """, prelude=prelude)
        assert "refused, nothing freed" in out, out


def test_empty_cache_gives_the_memory_back_to_the_device():
    # Note [Giving back to the device]: torch.cuda.empty_cache() promises the released memory
    # to other applications and to nvidia-smi. The pool freed its segments into its
    # cudaMemPool in stream order and waited for nothing, so the device still counted them
    # used until some later sync: PyTorch's own test_device_memory_used saw the device's
    # used bytes not grow by a new tensor's size across an empty_cache. Here a 256 MiB block
    # is cached, then emptied: the device's free memory (cudaMemGetInfo, no sync of its own)
    # must grow by it at once, and grow again by a tensor's size when that one is freed.
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run("""
            MiB = 1 << 20
            x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            del x                                   # cached, not given back
            before, _ = torch.cuda.mem_get_info()
            torch.cuda.empty_cache()
            after, _ = torch.cuda.mem_get_info()
            assert after - before >= 256 * MiB, (before, after)
            # PyTorch's test_device_memory_used, with cudaMemGetInfo for NVML.
            a = torch.cuda.mem_get_info()[0]
            y = torch.empty(512 * MiB, dtype=torch.int8, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            b = torch.cuda.mem_get_info()[0]
            assert 512 * MiB // 32 <= a - b <= 512 * MiB * 32, (a, b)
            print("given back", (after - before) // MiB, (a - b) // MiB)
        """, prelude=prelude)
        assert "given back" in out, out
