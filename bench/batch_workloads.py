"""The largest-batch workloads of bench/torch_workloads.py: the largest batch of a training
step that fits under a fixed memory cap, found in one process, and the table that sets the
models side by side per allocator.

  batch         the GPT-2 style decoder's step (AdamW, bf16 autocast), sequences of 512;
  batch-llama   the Llama-style decoder's step, trained the same way, sequences of 512;
  batch-resnet  torchvision's ResNet-50 step (SGD, ``cudnn.benchmark``), 224x224 images.

The cap is ``torch.cuda.set_per_process_memory_fraction(cap / total memory)``, which every
allocator of torch_workloads.py honours, so one cap holds for all of them. torch_workloads.py
owns the models and their steps; this module owns the search, the inputs and the table, and
imports nothing beyond the standard library until a workload runs.
"""
from __future__ import annotations

GiB = 1 << 30
DEFAULT_CAP_GIB = 24.0
START = 4
# Far above what any of the three models fits in a device's memory: a search that reaches it
# says the step does not bind the cap (a broken step, or a cap larger than the model needs)
# rather than galloping on until the inputs alone exhaust the host.
MAX_BATCH = 4096
SEQUENCE = 512
IMAGE = 224
VOCAB = 32000       # the token range of torch_workloads.py's models
CLASSES = 1000      # ResNet-50's classes

# The workloads, in the order of the table's rows, with the label each row carries.
MODELS = {"batch": "GPT-2 style decoder, length 512",
          "batch-llama": "Llama-style decoder, length 512",
          "batch-resnet": "ResNet-50, 224x224 images"}
WORKLOADS = tuple(MODELS)


def largest_fitting(fits, start: int = START, limit: int = MAX_BATCH) -> int:
    """The largest batch b in 1..limit for which ``fits(b)`` is true, assuming fitting is
    monotone (b fits whenever b + 1 does); 0 when not even batch 1 fits.

    The search gallops up from `start`, doubling while batches fit (the last step clipped to
    `limit`); if `start` itself does not fit, it halves down until a batch fits (or batch 1
    fails). It then bisects between the highest batch that fitted and the lowest that did
    not. `fits` is called at most once per batch, about 2 log2(answer / start) times, so
    each trial may be a real training step. A search that reaches `limit` returns `limit`
    without trying beyond it: the answer is then "at least `limit`".

    Fitting need not be monotone near the cap (the sizes shift from one batch to the next,
    and a block that missed a free hole at b may fit one at b + 1). Then the answer is still
    a batch that fitted with the batch above it failing, but a larger batch that was never
    tried may fit too: the answer is the boundary the search met, not a proof that nothing
    above it fits.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if start < 1:
        raise ValueError(f"start must be at least 1, got {start}")
    start = min(start, limit)
    if fits(start):
        lo = start                  # the highest batch that fitted
        while True:
            if lo == limit:
                return limit
            hi = min(lo * 2, limit)
            if not fits(hi):
                break
            lo = hi
    else:
        hi = start                  # the lowest batch that did not fit
        while True:
            if hi == 1:
                return 0
            lo = hi // 2
            if fits(lo):
                break
            hi = lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def tokens(torch, batch):
    """A batch of sequences for a causal LM step: (ids,)."""
    return (torch.randint(0, VOCAB, (batch, SEQUENCE), device="cuda"),)


def images(torch, batch):
    """A batch of images and labels for ResNet-50's step: (x, y)."""
    return (torch.randn(batch, 3, IMAGE, IMAGE, device="cuda"),
            torch.randint(0, CLASSES, (batch,), device="cuda"))


def largest_batch(torch, cap_gib, build, inputs, start=START, limit=MAX_BATCH):
    """The workload's row: the cap set first, then ``step, opt = build()`` (a training step
    and its optimizer), then the largest batch for which ``step(*inputs(torch, batch))`` runs
    with no ``torch.OutOfMemoryError``. Every trial runs in this process after the ones
    before it, as a training script would that tried batch sizes until one ran; the
    gradients of a failed trial are dropped before the next. Any other error ends the run
    (the row then holds it), so that a broken step is not reported as a small batch."""
    total = torch.cuda.get_device_properties(0).total_memory
    if cap_gib * GiB > total:
        raise ValueError(f"--batch-cap-gib {cap_gib:g} exceeds the device's "
                         f"{total / GiB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap_gib * GiB / total, 0)
    step, opt = build()
    trials = []

    def fits(batch):
        args = None
        try:
            args = inputs(torch, batch)
            step(*args)
            torch.cuda.synchronize()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        finally:
            args = None
            opt.zero_grad(set_to_none=True)
        trials.append([batch, ok])
        return ok

    found = largest_fitting(fits, start, limit)
    return {"largest_batch": found, "cap_gib": cap_gib, "search_limit": limit,
            "reached_limit": found == limit, "trials": trials,
            "ms_per_step": None, "values": []}


# ---- the table --------------------------------------------------------------------------

def side_by_side(rows, allocators):
    """Markdown: one row per largest-batch workload, one column per allocator (in the order
    given, then any other seen), each cell the largest batch ("-" where the run failed or
    did not run, ">=" where the search reached its limit)."""
    rows = [r for r in rows if r.get("workload") in MODELS]
    seen = [a for a in allocators if any(r.get("allocator") == a for r in rows)]
    seen += sorted({r.get("allocator") for r in rows} - set(seen), key=str)
    if not rows:
        return ""
    caps = sorted({r["cap_gib"] for r in rows if "cap_gib" in r})
    cap = ", ".join(f"{c:g}" for c in caps) or "?"
    lines = [f"largest batch under a {cap} GiB cap",
             "| model | " + " | ".join(seen) + " |", "|---|" + "---|" * len(seen)]
    for w in WORKLOADS:
        mine = [r for r in rows if r["workload"] == w]
        if not mine:
            continue
        cells = []
        for a in seen:
            got = [r for r in mine if r.get("allocator") == a and "largest_batch" in r]
            cells.append(", ".join((">=" if r.get("reached_limit") else "")
                                   + str(r["largest_batch"]) for r in got) or "-")
        lines.append(f"| {MODELS[w]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
