"""Statistics, settings, the memory fraction, the profiler and caching turned off, as PyTorch
scripts read and set them under the pool.

The scripts use PyTorch's own API only, as a training or inference script would, and check
that the answers are the pool's (each in a fresh interpreter: tests/_torch_scripts.py)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import PRELUDE, FRACTION_256_MIB_ABOVE_NOW, run, NATIVE_PRELUDE  # noqa: E402


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


def test_runtime_allocator_settings_act_on_the_pool():
    """torch.cuda.memory._set_allocator_settings reaches PyTorch as before (its pinned-memory
    keys act), the rounding and split keys change the pool as they would PyTorch's allocator
    (memory_stats sees each tensor's block rounded as PyTorch's own test_allocator_settings
    expects), and expandable_segments switches the kind of later segments without a word
    (tests/gpu/test_gpu_torch_segment_kind.py)."""
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
        assert said == [], said
        assert mempool._core._torch_kind_switched(0)
        assert pool.options["expandable_segments"] is False
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
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


# Compares the device's free bytes at two moments: another test on the device moves them.
@pytest.mark.gpu_exclusive
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


def test_the_cuda_sanitizer_sees_a_block_handed_out_again_as_a_new_tensor():
    # torch.cuda._sanitizer (TORCH_CUDA_SANITIZER=1) keeps each address's accesses until the
    # allocator says the block was freed. Before the pool said so, y's first write was
    # reported as a race with s's read of x. The same script under PyTorch's own allocator
    # shows that the case is no race.
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run(SANITIZED_REUSE, prelude=prelude)
        assert "no race reported 1048576.0 0.0" in out, out


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


# Compares the device's free bytes at two moments: another test on the device moves them.
@pytest.mark.gpu_exclusive
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
