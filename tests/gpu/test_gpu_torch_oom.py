"""Out of memory under the pool: PyTorch's error type, observers, callbacks, the profiler's mark,
and what a released MemPool still caches.

The scripts use PyTorch's own API only, as a training or inference script would, and check
that the answers are the pool's (each in a fresh interpreter: tests/_torch_scripts.py)."""
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import PRELUDE, FRACTION_256_MIB_ABOVE_NOW, run, CPP_BUILD, NATIVE_PRELUDE  # noqa: E402


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
