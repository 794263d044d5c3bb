"""A mempool pool as PyTorch's CUDA allocator (the pluggable-allocator entry points).

    python examples/torch_allocator.py [--backend cuda|sim]

On a GPU, ``mempool.torch.install(pool)`` (before PyTorch initialises CUDA) makes every CUDA
tensor come from the pool, backward's allocations on the autograd thread included;
``torch.cuda.empty_cache()`` empties the pool's cache and ``Tensor.record_stream`` reaches
the pool. Without a GPU (``--backend sim``) the example calls the same C entry points
PyTorch would, through ctypes, on two simulated devices.
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mempool                      # noqa: E402
import mempool.torch as mt          # noqa: E402
from _common import parse_backend, report, require, size_text   # noqa: E402


def on_gpu() -> None:
    pool = mempool.Pool(backend="cuda", device=0)
    mt.install(pool)                            # before any CUDA tensor
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(),
                                torch.nn.Linear(8192, 2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    side = torch.cuda.Stream()
    for step in range(10):
        x = torch.randn(512, 2048, device="cuda")
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.cuda.stream(side):           # a use on another stream, declared
            side.wait_stream(torch.cuda.current_stream())
            stat = x.abs().max()
        x.record_stream(side)
    torch.cuda.synchronize()
    print(f"loss {float(loss):.5f}, side {float(stat):.3f}")
    report(pool, "after 10 training steps (every CUDA tensor from the pool)")
    del x, loss, stat
    torch.cuda.empty_cache()                    # -> the pool's empty_cache
    report(pool, "after torch.cuda.empty_cache()")
    print(f"   torch calls: {mt.counters(0)}")
    pool.check_invariants()


def on_sim() -> None:
    ep = mt.entry_points()
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                             ctypes.c_void_p)(ep["alloc"])
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                            ctypes.c_void_p)(ep["free"])
    pools = [mempool.Pool(backend="sim", device=dev, capacity="80GB") for dev in range(2)]
    for dev, pool in enumerate(pools):
        mempool._core._torch_register(dev, pool)   # what mt.register does for cuda pools
    held = [(alloc(n << 20, dev, None), n << 20, dev) for dev in (0, 1) for n in (1, 8, 64)]
    print(f"   {len(held)} blocks through mempool_torch_alloc, "
          f"device 2 (unregistered) -> {alloc(1 << 20, 2, None)}")
    for dev, pool in enumerate(pools):
        report(pool, f"device {dev}")
    for ptr, n, dev in held:
        free(ptr, n, dev, None)
    for dev, pool in enumerate(pools):
        mempool._core._torch_unregister(dev)
        print(f"   device {dev} after the frees: used {size_text(pool.used_bytes())}")
        pool.check_invariants()


def main(argv: list[str] | None = None) -> int:
    args = parse_backend(__doc__.splitlines()[0], "sim", argv)
    if args.backend == "cuda":
        require("torch", "PyTorch with CUDA", "torch")
    print(f"backend: {args.backend}; entry points in {mt.library_path()}")
    on_gpu() if args.backend == "cuda" else on_sim()
    return 0


if __name__ == "__main__":
    sys.exit(main())
