"""Zero-copy hand-off of pool memory to PyTorch through DLPack.

    python examples/torch_handoff.py [--backend cuda|host]

``torch.from_dlpack(pool.empty(...))`` gives a tensor on the pool's memory: same address,
no copy. On CUDA, PyTorch passes its current stream; mempool makes that stream wait for the
buffer's stream (an event, no host sync) and records it as a user of the block, so the pool
does not reuse the memory before PyTorch's work is done. Deleting the tensor returns the
block (its deleter is C and may run on PyTorch's autograd threads).
"""
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mempool                      # noqa: E402
from _common import parse_backend, report, require   # noqa: E402


def handoff(backend: str, producer: Any) -> None:
    import torch
    pool = mempool.Pool(backend="cuda", device=0) if backend == "cuda" else \
        mempool.Pool(backend="host", capacity="1GB")
    buf = pool.empty((1024, 1024), "float32", stream=producer)
    ptr = buf.ptr
    x = torch.from_dlpack(buf)                              # the hand-off
    print(f"buffer at {ptr:#x}; tensor at {x.data_ptr():#x}; same memory: {x.data_ptr() == ptr}")
    assert x.data_ptr() == ptr and buf.exported
    x.normal_()
    w = torch.from_dlpack(pool.empty((1024, 256), "float32", stream=producer)).normal_()
    x.requires_grad_()
    loss = (x @ w).tanh().sum()
    loss.backward()                                         # grads from PyTorch's allocator
    print(f"loss {loss.item():.4f}; grad norm {x.grad.norm().item():.4f}")
    report(pool, "two tensors on pool memory")
    del x, w, loss, buf   # the Buffer holds its block too, until its last holder goes
    if backend == "cuda":
        torch.cuda.synchronize()
    report(pool, "after the tensors died (their deleters freed the blocks)")
    pool.check_invariants()


def main(argv: list[str] | None = None) -> int:
    args = parse_backend(__doc__.splitlines()[0], "host", argv)
    require("torch", "PyTorch (the CPU build is enough on host)", "torch")
    print(f"backend: {args.backend}")
    producer = None
    if args.backend == "cuda":
        import cupy
        # The stream the buffers are written on. Made before the pool and dropped after it:
        # the pool keeps segments made on a stream until it goes.
        producer = cupy.cuda.Stream(non_blocking=True)
    handoff(args.backend, producer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
