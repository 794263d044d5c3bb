"""A trainer hands its model's weights to a reader (inference) process every step, through
torch.multiprocessing, both processes on mempool's pool.

    python examples/trainer_to_reader.py [--steps 5]

Each process makes a pool on the GPU and installs it as PyTorch's CUDA allocator
(``mempool.torch.install``) before CUDA starts there. Every step the trainer takes an AdamW
step, copies its weights (a ``state_dict`` of CUDA tensors, blocks of its pool) and puts them
on a queue of a ``spawn`` context: PyTorch sends each CUDA tensor as a handle to the memory,
not as a copy, and the reader opens it in place. With the weights come their sums and a
probe batch, taken by the trainer; the reader checks the sums of what it received, runs the
probe batch through the received weights and sends its output's sum back, which the trainer
compares with its own forward pass on the same weights. The trainer keeps each step's copy
until the reader has answered for it, as PyTorch requires of a process sharing CUDA memory.

Without PyTorch or a GPU the example says so in one line and exits 0: what it shows is CUDA
memory crossing processes.
"""
import argparse
import math
import os
import queue
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import gpu_available, require   # noqa: E402

WIDTH, HIDDEN, BATCH = 512, 2048, 64
# The sums are of the same values in both processes, reduced by the same kernel: equal to
# the last bits. The forward pass may pick another GEMM kernel in the reader.
OUTPUT_REL_TOL = 1e-4


def model_of(torch: Any) -> Any:
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, WIDTH))


def sums(state: dict[str, Any]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in state.items()}


def reader(weights: Any, answers: Any, steps: int) -> None:
    import mempool
    import mempool.torch as mt
    pool = mempool.Pool(backend="cuda", device=0)
    mt.install(pool)                     # before this process's first CUDA call
    import torch
    model = model_of(torch).cuda()
    differed = 0
    for _ in range(steps):
        step, state, expected, probe = weights.get()
        got = sums(state)
        wrong = sorted(k for k in expected
                       if not math.isclose(got[k], expected[k], rel_tol=0, abs_tol=0))
        with torch.no_grad():
            torch.func.functional_call(model, state, (probe,))   # warm the kernels
            out = float(torch.func.functional_call(model, state, (probe,)).double().sum())
        differed += bool(wrong)
        del state, probe                 # done with this step's weights
        torch.cuda.synchronize()
        answers.put((step, wrong, out))
    print(f"reader: {steps} steps of weights received from the trainer, "
          f"{steps - differed} with every value as sent; "
          f"reader's pool allocations {pool.stats()['allocation.all.allocated']}", flush=True)
    if differed:
        sys.exit(1)


def answer(answers: Any, child: Any) -> Any:
    """The reader's next answer; an error naming its exit status if it died first."""
    while True:
        try:
            return answers.get(timeout=1)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the reader exited (status {child.exitcode}) without "
                                   f"answering") from None


def trainer(steps: int) -> int:
    import mempool
    import mempool.torch as mt
    pool = mempool.Pool(backend="cuda", device=0)
    mt.install(pool)                     # before this process's first CUDA call
    import torch
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    weights, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=reader, args=(weights, answers, steps))
    child.start()
    torch.manual_seed(0)
    model = model_of(torch).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = 0.0
    try:
        for step in range(steps):
            loss = model(torch.randn(BATCH, WIDTH, device="cuda")).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            probe = torch.randn(BATCH, WIDTH, device="cuda")
            with torch.no_grad():
                mine = float(torch.func.functional_call(model, state, (probe,)).double().sum())
            weights.put((step, state, sums(state), probe))
            got_step, wrong, theirs = answer(answers, child)
            assert got_step == step, f"the reader answered for step {got_step}, not {step}"
            assert not wrong, f"step {step}: the reader received other values in {wrong}"
            error = abs(theirs - mine) / max(abs(mine), 1e-30)
            assert error <= OUTPUT_REL_TOL, (
                f"step {step}: the reader's output sums to {theirs}, the trainer's to {mine}")
            worst = max(worst, error)
            del state, probe             # the reader has answered for them
    finally:
        child.join(timeout=300)
    assert child.exitcode == 0, f"the reader exited with status {child.exitcode}"
    torch.cuda.synchronize()
    pool.check_invariants()
    print(f"trainer: {steps} steps, each step's weights sent to the reader and checked there; "
          f"its outputs on them within {worst:.1e} of the trainer's; loss {float(loss):.5f}; "
          f"trainer's pool allocations {pool.stats()['allocation.all.allocated']}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps: {args.steps} is not a positive number of steps")
    require("torch", "PyTorch (with CUDA)", "torch")
    if not gpu_available():
        print("trainer_to_reader.py: skipped, it needs a CUDA GPU (CUDA tensors shared between "
              "two processes) and none was found here (on a GPU machine: pip install torch "
              "cupy-cuda12x)")
        return 0
    return trainer(args.steps)


if __name__ == "__main__":
    sys.exit(main())
