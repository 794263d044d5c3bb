"""All-reduce and DDP training on mempool pools: one process per device, one pool each.

    python examples/ddp_allreduce.py [--backend cuda|host] [--procs N] [--steps K]
                                     [--expandable]

``--backend cuda`` (N GPUs, default all of them): each process makes a pool on its own GPU
and installs it as PyTorch's CUDA allocator (``mempool.torch.install``) before CUDA starts
there, so every tensor of the process (parameters, activations, DDP's gradient buckets, the
tensors NCCL reduces) is a block of that pool. The processes join one NCCL group; an
all_reduce of pool tensors must give the exact sum, then K DistributedDataParallel steps run
and the pool's stats account for them. NVLink multicast (NVLS) stays off
(``NCCL_NVLS_ENABLE=0``, set before NCCL initialises in any process): NCCL would allocate
its multicast buffers through the driver, outside any pool, and does not need them here.

``--backend host`` (no GPU): the same processes over gloo, all-reducing host-pool buffers
handed to PyTorch through DLPack, one fresh pool buffer per step, with exact accounting.
"""
import argparse
import os
import socket
import sys
from typing import Any

# Before NCCL initialises: in this process and, through the environment, in every worker.
os.environ["NCCL_NVLS_ENABLE"] = "0"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def say(line: str) -> None:
    """One write per line, so that the workers' lines do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, world: int, port: int, backend: str) -> Any:
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return dist


def _expected_sum(world: int) -> float:
    return world * (world + 1) / 2   # ranks contribute 1, 2, ..., world


def worker_cuda(rank: int, world: int, port: int, steps: int, expandable: bool) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # This process's GPU current first, so that the CUDA runtime calls made while the pool
    # is set up start no context on GPU 0 (a context costs hundreds of MiB per process).
    from cupy.cuda import runtime
    runtime.setDevice(rank)
    import mempool
    import mempool.torch as mt
    pool = mempool.Pool(backend="cuda", device=rank, expandable_segments=expandable)
    mt.install(pool)                    # before the first CUDA call of this process
    import torch
    from torch.nn.parallel import DistributedDataParallel
    torch.cuda.set_device(rank)
    dist = _join(rank, world, port, "nccl")

    # 1. An all-reduce of pool tensors.
    x = torch.full((1 << 22,), float(rank + 1), device="cuda")
    pool.block_info(x.data_ptr())       # raises unless x is a block of this process's pool
    dist.all_reduce(x)
    torch.cuda.synchronize()
    want = _expected_sum(world)
    assert bool((x == want).all()), f"rank {rank}: all_reduce gave {x[:4].tolist()}, not {want}"
    say(f"rank {rank}: all_reduce of {x.numel()} floats from the pool on cuda:{rank} = "
        f"{x[0].item():g} (expected {want:g})")
    del x

    # 2. DDP steps.
    torch.manual_seed(0)                # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    ddp = DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)   # different data per rank
    before = pool.stats()
    for _ in range(steps):
        batch = torch.randn(256, 1024, device="cuda", generator=gen)
        loss = ddp(batch).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()                 # DDP all-reduces the gradient buckets here
        opt.step()
    torch.cuda.synchronize()
    after = pool.stats()

    # DDP keeps the replicas equal: rank 0's parameters, broadcast, match everyone's.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = torch.equal(ref, flat)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    allocs = after["allocation.all.allocated"] - before["allocation.all.allocated"]
    assert same, f"rank {rank}: parameters differ from rank 0's after {steps} DDP steps"
    assert allocs > 0, "the DDP steps allocated nothing from the pool"
    assert after["allocated_bytes.all.current"] == pool.used_bytes()
    assert pool.used_bytes() >= 2 * param_bytes, "parameters and gradients are not in the pool"
    assert mt.counters(rank)["failed_allocs"] == 0
    pool.check_invariants()
    say(f"rank {rank}: {steps} DDP steps, loss {loss.item():.5f}, replicas equal: {same}; "
        f"pool allocations during the steps {allocs}, used {pool.used_bytes()} bytes "
        f"(parameters {param_bytes}), peak {after['allocated_bytes.all.peak']}, "
        f"reserved {pool.reserved_bytes()}")
    dist.destroy_process_group()


def worker_host(rank: int, world: int, port: int, steps: int, expandable: bool) -> None:
    import mempool
    import torch
    pool = mempool.Pool(backend="host", capacity="1GiB", expandable_segments=expandable)
    dist = _join(rank, world, port, "gloo")
    want = _expected_sum(world)
    n = 1 << 16
    for step in range(1 + steps):
        x = torch.from_dlpack(pool.empty((n,), "float32"))   # a block of the pool, no copy
        pool.block_info(x.data_ptr())
        x.fill_(float(rank + 1))
        dist.all_reduce(x)
        assert bool((x == want).all()), f"rank {rank} step {step}: got {x[:4].tolist()}"
        del x                           # the DLPack deleter frees the block
    # gloo's work object may hold the last tensor a moment longer, on its own thread: the
    # deleter runs wherever the last reference goes, so wait for it (bounded).
    import gc
    import time
    deadline = time.monotonic() + 10
    while pool.used_bytes() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    st = pool.stats()
    assert st["allocation.all.allocated"] == 1 + steps and st["allocation.all.freed"] == 1 + steps
    assert pool.used_bytes() == 0
    pool.check_invariants()
    say(f"rank {rank}: {1 + steps} all_reduces over gloo of {n} floats from a host pool = "
        f"{want:g} each; pool allocations {st['allocation.all.allocated']}, frees "
        f"{st['allocation.all.freed']}, used {pool.used_bytes()}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from _common import gpu_available
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "host"),
                    default="cuda" if gpu_available() else "host")
    ap.add_argument("--procs", type=int, default=None,
                    help="processes (one per GPU on cuda); default: every GPU, or 2 on host")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--expandable", action="store_true",
                    help="pools with expandable segments")
    args = ap.parse_args(argv)
    from _common import require
    require("torch", "PyTorch (the CPU build is enough on host)", "torch")
    import torch.multiprocessing as tmp
    if args.backend == "cuda":
        require("cupy", "CuPy (it counts the devices)", "cupy-cuda12x")
        from cupy.cuda import runtime   # counting devices must not start CUDA in torch
        count = runtime.getDeviceCount()
        procs = args.procs or count
        if not 1 <= procs <= count:
            ap.error(f"--procs {procs}: this machine has {count} GPU(s)")
        worker = worker_cuda
    else:
        procs = args.procs or 2
        worker = worker_host
    # NCCL_NVLS_ENABLE matters to NCCL only, so only the cuda run names it.
    say(f"backend: {args.backend}; {procs} processes over "
        + (f"NCCL, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}" if args.backend == "cuda"
           else "gloo"))
    tmp.spawn(worker, args=(procs, _free_port(), args.steps, args.expandable), nprocs=procs,
              join=True)
    say("all ranks agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
