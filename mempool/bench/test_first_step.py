"""First step: the first iteration of a small training loop, with a cold allocator.

The pattern (``training_step``) is the allocation sequence of one step of a 6-layer MLP
(hidden 2048, batch 32, fp32) trained with Adam, model creation included: parameters,
forward activations kept for backward, gradients, the optimizer's two state tensors per
parameter (created on the first step) and its temporaries, about 400 MiB at peak. Timed is
the host-side allocator work of the whole iteration, one iteration per round:

- ``cold``: a pool that has never allocated (mempool: a new Pool; PyTorch: after
  ``torch.cuda.empty_cache()``; CuPy: a new MemoryPool), so every segment comes from upstream;
- ``initial_pool_size``: a new mempool Pool created with ``initial_pool_size`` = the pattern's
  peak (creating it is not timed), the option meant to take that cost off the first step;
- ``warm``: the same iteration on an allocator that has run it once before (the floor).

extra_info keeps how many segments the pool took from upstream during the timed iteration.
"""
import functools

import pytest

from .benchkit import GPU_MARKS, MiB, measure, require_gpu
from .contenders import new_pool, torch_cuda


def training_step(layers=6, batch=32, hidden=2048, dtype_bytes=4):
    """The allocation events of model creation plus one training step.

    Returns ``(plan, nslots, peak)``: plan entries are ``(True, slot, nbytes)`` to allocate
    into a slot and ``(False, slot, 0)`` to free it; slots still held at the end are the
    model's persistent state; `peak` is the most bytes live at once.
    """
    plan, live, peak = [], {}, 0
    counter = iter(range(1 << 30))

    def alloc(nbytes):
        nonlocal peak
        slot = next(counter)
        plan.append((True, slot, nbytes))
        live[slot] = nbytes
        peak = max(peak, sum(live.values()))
        return slot

    def free(slot):
        plan.append((False, slot, 0))
        del live[slot]

    weight, bias = hidden * hidden * dtype_bytes, hidden * dtype_bytes
    act = batch * hidden * dtype_bytes
    params = [(alloc(weight), alloc(bias)) for _ in range(layers)]
    saved = []
    x = alloc(act)
    for _ in range(layers):                      # forward: pre-activation and output kept
        pre, out = alloc(act), alloc(act)
        saved.append((x, pre))
        x = out
    loss = alloc(512)
    grad_out = alloc(act)
    grads = []
    for inp, pre in reversed(saved):             # backward
        grad_pre = alloc(act)
        free(grad_out)
        grads.append((alloc(weight), alloc(bias)))
        grad_out = alloc(act)
        free(grad_pre)
        free(pre)
        free(inp)
    free(grad_out)
    free(x)
    free(loss)
    for w, b in params:                           # Adam: state created on the first step
        for nbytes in (weight, bias):
            alloc(nbytes), alloc(nbytes)          # exp_avg, exp_avg_sq
            tmp = alloc(nbytes)
            free(tmp)
    return plan, next(counter), peak


PLAN, NSLOTS, PEAK = training_step()


def run_plan(alloc, free, slots):
    if free is None:
        for op, slot, nbytes in PLAN:
            slots[slot] = alloc(nbytes) if op else None
    else:
        for op, slot, nbytes in PLAN:
            if op:
                slots[slot] = alloc(nbytes)
            else:
                free(slots[slot])
                slots[slot] = None


def release(slots, free):
    if free is not None:
        for handle in slots:
            if handle is not None:
                free(handle)
    slots[:] = [None] * len(slots)


class FirstStep:
    """Rounds of one iteration each; `fresh()` gives (alloc, free, state) per round."""

    def __init__(self, fresh, cold):
        self.fresh = fresh
        self.cold = cold
        self.slots = [None] * NSLOTS
        self.current = None

    def setup(self):
        # Tearing the last round down here keeps it untimed, with benchmarks on or off.
        self.teardown()
        if self.current is None or self.cold:
            self.current = self.fresh()
        return (), {}

    def target(self):
        alloc, free, _ = self.current
        before = self.current[2].segments()
        run_plan(alloc, free, self.slots)
        self.segments = self.current[2].segments() - before

    def teardown(self):
        if self.current is not None:
            release(self.slots, self.current[1])
            if self.cold:
                self.current[2].close()

    def warm_once(self):
        self.setup()
        self.target()


class _PoolState:
    def __init__(self, pool):
        self.pool = pool

    def segments(self):
        return self.pool.stats().get("segment.all.allocated", 0)

    def close(self):
        self.pool.empty_cache()


def mempool_fresh(backend, **options):
    def fresh():
        pool = new_pool(backend, **options)
        return pool.alloc, pool.free, _PoolState(pool)
    return fresh


class _TorchState:
    def __init__(self, torch):
        self.torch = torch

    def segments(self):
        return self.torch.cuda.memory_stats().get("segment.all.allocated", 0)

    def close(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()


def torch_fresh():
    torch = torch_cuda()
    alloc = functools.partial(torch.empty, dtype=torch.uint8, device="cuda")

    def fresh():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return alloc, None, _TorchState(torch)
    return fresh


class _CupyState:
    def __init__(self, pool):
        self.pool = pool

    def segments(self):
        return 0   # CuPy's pool does not count its upstream calls

    def close(self):
        self.pool.free_all_blocks()


def cupy_fresh():
    require_gpu()
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

    def fresh():
        pool = cupy.cuda.MemoryPool()
        return pool.malloc, None, _CupyState(pool)
    return fresh


INITIAL = {"initial_pool_size": -(-PEAK // (2 * MiB)) * 2 * MiB}
ROWS = [
    # id, label, column, fresh factory, cold, gpu, ref
    ("mempool-sim-cold", "mempool (sim)", "cold", lambda: mempool_fresh("sim"), True, False, 1),
    ("mempool-sim-initial", "mempool (sim)", "initial_pool_size",
     lambda: mempool_fresh("sim", **INITIAL), True, False, 1),
    ("mempool-sim-warm", "mempool (sim)", "warm", lambda: mempool_fresh("sim"), False, False, 1),
    ("mempool-cuda-cold", "mempool (cuda)", "cold", lambda: mempool_fresh("cuda"), True, True, 0),
    ("mempool-cuda-initial", "mempool (cuda)", "initial_pool_size",
     lambda: mempool_fresh("cuda", **INITIAL), True, True, 0),
    ("mempool-cuda-warm", "mempool (cuda)", "warm", lambda: mempool_fresh("cuda"), False, True, 0),
    ("torch-cold", "torch.empty (caching allocator)", "cold", torch_fresh, True, True, None),
    ("torch-warm", "torch.empty (caching allocator)", "warm", torch_fresh, False, True, None),
    ("cupy-cold", "CuPy MemoryPool.malloc", "cold", cupy_fresh, True, True, None),
    ("cupy-warm", "CuPy MemoryPool.malloc", "warm", cupy_fresh, False, True, None),
]
ORDER = {"cold": 0, "initial_pool_size": 1, "warm": 2}


@pytest.mark.parametrize("cid,label,column,factory,cold,gpu,ref", [
    pytest.param(*row, id=row[0], marks=GPU_MARKS if row[5] else ()) for row in ROWS])
def test_first_step(benchmark, cid, label, column, factory, cold, gpu, ref):
    step = FirstStep(factory(), cold)
    try:
        if not cold:
            step.warm_once()
        measure(benchmark, step.target, 1, section="first step", row=label, column=column,
                order=ORDER[column], ref=ref, unit="iteration", setup=step.setup,
                events=len(PLAN), peak_bytes=PEAK)
        benchmark.extra_info["upstream_segments"] = step.segments
    finally:
        step.teardown()
        if step.current is not None:
            step.current[2].close()
