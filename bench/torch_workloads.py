"""Real PyTorch workloads under four allocators, side by side, each run in a process of its own.

    python bench/torch_workloads.py OUTDIR [--steps 30] [--reps 2] [--workloads gpt,gpt-bucketed,resnet,infer,batch,empty]
    python bench/torch_workloads.py OUTDIR --workloads resnet --allocators torch --reps 1 --snapshot
    python bench/torch_workloads.py OUTDIR --workloads batch,batch-resnet,batch-llama [--batch-cap-gib 24]

Workloads (model code from Hugging Face ``transformers`` and ``torchvision``, random
weights, built from a config; nothing here defines a model):
  gpt     a GPT-2 style decoder (8 layers, hidden 1024, 16 heads) trained with AdamW under
          bf16 autocast on batches of 8 sequences whose length changes every step (64-512);
  gpt-bucketed  the same with lengths padded to multiples of 64, every bucket seen in the
          warm-up: the steady state, where step times can tell allocators apart;
  llama-bucketed  a Llama-style decoder (``LlamaForCausalLM``: rotary positions, SwiGLU,
          RMSNorm; 8 layers, hidden 1024) trained as gpt-bucketed;
  resnet  torchvision's ResNet-50 trained with SGD, ``torch.backends.cudnn.benchmark = True``;
  lightning  the same ResNet-50 trained by Lightning's ``Trainer`` (bf16 mixed precision,
          ``benchmark=True``, ``DeviceStatsMonitor``): a loop nobody here wrote;
  infer   the GPT model's forward under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs);
  batch   the largest batch of the GPT step (length 512) that fits under a fixed cap
          (``--batch-cap-gib``, 24 by default), found in one process (batch_workloads.py);
  batch-resnet, batch-llama  the same for the ResNet-50 step (224x224 images) and the Llama
          step (length 512); the three print side by side, one row per model (not in the
          default list);
  empty   ``torch.empty`` + drop, six pairs of processes (one per allocator, side by side
          on one CPU, their rounds interleaved: empty_pairs.py); ``--empty-control
          caching`` adds as many pairs of PyTorch's allocator against itself, the spread
          that two processes of one allocator show.
Allocators: PyTorch's default, PyTorch with ``expandable_segments:True``, mempool's default
and mempool with expandable segments (``mempool.torch.install``). For each: ms per step
(median over the timed steps, after warm-up), peak reserved, and the losses or outputs, so
that mempool's can be compared with PyTorch's own spread between two runs. Writes
OUTDIR/workloads.json and prints a table (and the largest batches, model by allocator).
A benchmark, not a test: it asserts nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import batch_workloads   # this folder's; stdlib only at import

ALLOCATORS = ("torch", "torch-expandable", "mempool", "mempool-expandable")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- the child: one workload under one allocator ------------------------------------------

POOL = None   # the child's mempool.Pool, under the mempool allocators

# Upstream traffic and waits over the timed steps: a step time above PyTorch's with the same
# kernels is either these (a segment allocation or a sync inside a step leaves the GPU idle
# while the host catches up) or the kernels' own pace on the memory they were given.
TORCH_COUNTERS = ("num_device_alloc", "num_device_free", "num_sync_all_streams",
                  "num_alloc_retries", "segment.all.allocated", "segment.all.freed")
POOL_COUNTERS = ("num_stream_syncs", "num_stream_queries", "num_event_records",
                 "num_event_waits", "num_cross_stream_reuse")


def counters(torch):
    stats = torch.cuda.memory_stats()
    out = {k: stats.get(k) for k in TORCH_COUNTERS}
    if POOL is not None:
        pool_stats = POOL.stats()
        out.update({k: pool_stats.get(k) for k in POOL_COUNTERS})
    return out


# mempool's allocators: the Pool options of each. Besides ALLOCATORS, --allocators takes
# "mempool-expandable-2mib": expandable segments with PyTorch's page size instead of the
# default 8 MiB on cuda, to see what the page costs in peak reserved on a real workload;
# "mempool-expandable-page": expandable segments with one physical allocation per page
# (max_map_size = the page), which can give back every free page (Note [Growth extents]);
# "mempool-expandable-map32" and "-map64": physical allocations of at most 32 or 64 MiB,
# between the two (on sim 64 MiB kept the shipped traces' peaks and took the GPT snapshot's
# from 1.062 to 1.034 of peak live, an earlier run (bench/results/ in git history));
# "mempool-seg32": the default path with segment_rounding 32 MiB (Note [Segment rounding]).
MEMPOOL_OPTIONS = {"mempool": {},
                   "mempool-expandable": {"expandable_segments": True},
                   "mempool-expandable-2mib": {"expandable_segments": True,
                                               "granularity": "2MiB"},
                   "mempool-expandable-page": {"expandable_segments": True,
                                               "max_map_size": "8MiB"},
                   "mempool-expandable-map32": {"expandable_segments": True,
                                                "max_map_size": "32MiB"},
                   "mempool-expandable-map64": {"expandable_segments": True,
                                                "max_map_size": "64MiB"},
                   "mempool-seg32": {"segment_rounding": "32MiB"}}


def setup_allocator(name):
    global POOL
    import torch
    if name in MEMPOOL_OPTIONS:
        import mempool
        import mempool.torch as mt
        POOL = mempool.Pool(backend="cuda", **MEMPOOL_OPTIONS[name])
        mt.install(POOL, allocator="full")
    return torch


def gpt_model(torch):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=8, n_embd=1024, n_head=16, n_positions=512, vocab_size=32000,
                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return GPT2LMHeadModel(cfg).cuda()


TIMED = {}   # what timed() saw besides the median: the child adds it to its result


def timed(torch, steps, warmup, body):
    times, values = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        if i == warmup:
            before = counters(torch)
        t0 = time.perf_counter()
        v = body(i)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        values.append(v)
    after = counters(torch)
    TIMED.update(ms_min=min(times), ms_max=max(times),
                 timed_steps_counters={k: (after[k] - before[k]) if None not in (after[k], before[k])
                                       else None for k in after})
    return statistics.median(times), values


# The bucketed variant's lengths: multiples of 64, as a loader that pads each batch to a
# bucket (Hugging Face's pad_to_multiple_of, length-grouped samplers) produces them.
GPT_BUCKETS = tuple(range(64, 513, 64))


def gpt_lengths(steps, warmup, bucketed, seed=1):
    """Sequence lengths of the GPT steps. Any length in 64-512 makes nearly every step a
    shape the process has not run before, so its time is largely first-time work for that
    shape (kernel selection, caches), which varies from process to process by more than
    the allocators differ (an earlier run (bench/results/ in git history): 14 %). Bucketed, the
    warm-up cycles through the buckets (each twice in run_gpt's 16 steps) and the timed
    steps draw from the same buckets: the steady state of a training run, where the
    allocator's own cost can show. `seed` draws another order (--order-seed)."""
    import random
    rng = random.Random(seed)
    if not bucketed:
        return [rng.randrange(64, 513) for _ in range(steps + warmup)]
    head = [GPT_BUCKETS[i % len(GPT_BUCKETS)] for i in range(warmup)]
    return head + [rng.choice(GPT_BUCKETS) for _ in range(steps)]


def llama_model(torch):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16,
                      num_key_value_heads=16, intermediate_size=2816, vocab_size=32000,
                      max_position_embeddings=512)
    return LlamaForCausalLM(cfg).cuda()


ORDER_SEED = 1   # --order-seed: the bucketed steps' order (gpt_lengths)


def lm_trainer(torch, make_model=gpt_model):
    """(step, opt): a causal LM's training step, step(ids) -> loss (AdamW, bf16 autocast),
    the one that the GPT, Llama and largest-batch workloads run."""
    model = make_model(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step, opt


def run_gpt(torch, steps, bucketed=False, make_model=gpt_model):
    train, _ = lm_trainer(torch, make_model)
    warmup = 2 * len(GPT_BUCKETS) if bucketed else 10
    lengths = gpt_lengths(steps, warmup, bucketed, seed=ORDER_SEED)
    g = torch.Generator(device="cuda").manual_seed(2)

    def step(i):
        ids = torch.randint(0, 32000, (8, lengths[i]), device="cuda", generator=g)
        return train(ids).item()

    ms, losses = timed(torch, steps, warmup, step)
    return {"ms_per_step": ms, "values": losses}


def run_gpt_bucketed(torch, steps):
    return run_gpt(torch, steps, bucketed=True)


def run_llama_bucketed(torch, steps):
    return run_gpt(torch, steps, bucketed=True, make_model=llama_model)


def resnet_trainer(torch):
    """(step, opt): torchvision's ResNet-50 training step, step(x, y) -> loss (SGD, cuDNN
    benchmark), the one that the resnet and batch-resnet workloads run."""
    import torchvision
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step, opt


def run_resnet(torch, steps):
    train, _ = resnet_trainer(torch)
    g = torch.Generator(device="cuda").manual_seed(2)

    def step(i):
        x = torch.randn(64, 3, 224, 224, device="cuda", generator=g)
        y = torch.randint(0, 1000, (64,), device="cuda", generator=g)
        return train(x, y).item()

    ms, losses = timed(torch, steps, 5, step)
    return {"ms_per_step": ms, "values": losses}


def run_infer(torch, steps):
    model = gpt_model(torch).eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = [torch.randint(0, 32000, (8, 256), device="cuda", generator=g) for _ in range(4)]

    def step(i):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled(ids[i % 4]).logits
        return float(logits.float().abs().mean().item())

    ms, outs = timed(torch, steps, 5, step)
    return {"ms_per_step": ms, "values": outs}


BATCH_CAP_GIB = batch_workloads.DEFAULT_CAP_GIB   # --batch-cap-gib


def run_batch(torch, steps):
    return batch_workloads.largest_batch(torch, BATCH_CAP_GIB, lambda: lm_trainer(torch),
                                         batch_workloads.tokens)


def run_batch_llama(torch, steps):
    return batch_workloads.largest_batch(torch, BATCH_CAP_GIB,
                                         lambda: lm_trainer(torch, llama_model),
                                         batch_workloads.tokens)


def run_batch_resnet(torch, steps):
    return batch_workloads.largest_batch(torch, BATCH_CAP_GIB, lambda: resnet_trainer(torch),
                                         batch_workloads.images)


def run_lightning(torch, steps, warmup=5):
    """torchvision's ResNet-50 trained by Lightning's own Trainer loop: bf16 mixed
    precision, cuDNN benchmark (``benchmark=True``), DeviceStatsMonitor reading
    ``torch.cuda.memory_stats()`` around every batch. Steps timed from each batch's start to
    its end (a callback synchronizes at both), the median of those after the warm-up."""
    import torchvision
    import tempfile
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor
        from lightning.pytorch.loggers import CSVLogger
    except ImportError:
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import Callback, DeviceStatsMonitor
        from pytorch_lightning.loggers import CSVLogger

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torchvision.models.resnet50(weights=None)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepTimes(Callback):
        def __init__(self):
            self.ms, self.losses, self.t0 = [], [], None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            self.ms.append((time.perf_counter() - self.t0) * 1e3)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.item()))

    pl.seed_everything(0)
    g = torch.Generator().manual_seed(2)
    n = (warmup + steps) * 64
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 224, 224, generator=g),
                                          torch.randint(0, 1000, (n,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=64, num_workers=0)
    times = StepTimes()
    # DeviceStatsMonitor refuses a Trainer without a logger: a CSV one, thrown away after.
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=warmup + steps,
                             precision="bf16-mixed", benchmark=True, logger=CSVLogger(logs),
                             callbacks=[DeviceStatsMonitor(), times], log_every_n_steps=1,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(Classifier(), loader)
    timed_ms = times.ms[warmup:]
    TIMED.update(ms_min=min(timed_ms), ms_max=max(timed_ms))
    return {"ms_per_step": statistics.median(timed_ms), "values": times.losses}


WORKLOADS = {"gpt": run_gpt, "gpt-bucketed": run_gpt_bucketed,
             "llama-bucketed": run_llama_bucketed, "resnet": run_resnet,
             "infer": run_infer, "batch": run_batch, "batch-llama": run_batch_llama,
             "batch-resnet": run_batch_resnet, "lightning": run_lightning}


def child(workload, allocator, steps, snapshot=None):
    torch = setup_allocator(allocator)
    if snapshot:
        # Every allocation and free of the run, in PyTorch's snapshot format: `python -m
        # mempool replay SNAPSHOT` replays it on sim under any setting, so that where a peak
        # comes from can be studied without a GPU. Recording costs time: not a timed run.
        torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)
    t0 = time.time()
    out = WORKLOADS[workload](torch, steps)
    if snapshot:
        import gzip
        import pickle
        with gzip.open(snapshot, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)
        out["snapshot"] = os.path.basename(snapshot)
    out.update(TIMED)
    out.update(workload=workload, allocator=allocator, wall_s=round(time.time() - t0, 1),
               peak_reserved=torch.cuda.max_memory_reserved(),
               peak_allocated=torch.cuda.max_memory_allocated(),
               backend=torch.cuda.memory.get_allocator_backend())
    if POOL is not None and not POOL.options["expandable_segments"]:
        # The cudaMemPool under mempool's default segments: the device memory the process
        # held at most (what the pool gave back stays there until the next synchronization,
        # Note [The driver keeps nothing given back]).
        stats = POOL.stats()
        out["driver_pool_reserved_high"] = stats.get("cuda_pool.reserved_high")
        out["driver_pool_used_high"] = stats.get("cuda_pool.used_high")
    print("RESULT " + json.dumps(out))


# ---- the parent ------------------------------------------------------------------------

def spawn(args, env_extra=None, timeout=900, cpus=None):
    """Run a child of this script (or another) and return the JSON it prints. `cpus` pins
    the child to that set of CPUs, so that children compared with each other run on cores
    of the same pace."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(env_extra or {})
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, preexec_fn=pin)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (done.stdout + done.stderr)[-3000:], "rc": done.returncode}


# Besides ALLOCATORS, --allocators takes "torch-async": PyTorch on the driver's stream-ordered
# pool (backend:cudaMallocAsync), whose memory is of the kind mempool's default segments are
# made of (cuMemAllocFromPoolAsync): a step time shared by it and mempool's default, and not
# by PyTorch's default, is the memory's and not the allocator's.
TORCH_CONFS = {"torch-expandable": "expandable_segments:True",
               "torch-async": "backend:cudaMallocAsync"}


def allocator_env(name):
    return {"PYTORCH_CUDA_ALLOC_CONF": TORCH_CONFS[name]} if name in TORCH_CONFS else {}


def cpu_paces(loops=1_000_000, probes=3):
    """ns per iteration of an empty Python loop on each CPU this process may use."""
    from mempool.tools.corpus_processes import cpu_paces as paces
    return paces(loops, probes)


# The workloads' children run on the CPUs of the fastest pace just before they start. Their
# step times follow the host's pace (a GPT-2 step of this size launches kernels faster than
# the GPU runs them only on a fast core): unpinned, one allocator's GPT steps took 129-177 ms
# from process to process on one machine, 82 ms on another
# (an earlier run (bench/results/ in git history)), which hid any difference between allocators.
# Two CPUs, not one: autograd's backward runs on a thread of its own beside the Python one.
# Only the eager training loops: compiled inference replays CUDA graphs (the host's pace
# matters little) and its compilation would get two CPUs' worth of worker processes, and
# the largest batch is not timed.
WORKLOAD_CPUS = 2
PINNED_WORKLOADS = ("gpt", "gpt-bucketed", "llama-bucketed", "resnet", "lightning")


def fastest_cpus(n):
    """The n CPUs of this process's set with the fastest pace now, and every CPU's pace."""
    paces = cpu_paces()
    return set(sorted(paces, key=paces.get)[:n]), paces


# 0 B: torch.empty's own cost, its allocator's call returning at once with no memory
# (neither allocator's deleter runs). Each round of the other sizes is followed by a 0 B
# round (empty_pairs.run_pair's floor), so that size less 0 B, round by round, is what the
# allocator adds to the call (allocator_shares).
EMPTY_FLOOR = 0
EMPTY_SIZES = (EMPTY_FLOOR, 512, 65536, 1048576, 67108864)


def allocator_shares(pair_caching, pair_mempool, size):
    """A pair's (caching, mempool) ns that the allocator adds to a torch.empty + drop of
    `size`: the median over rounds of each round less its 0 B round. None where either
    process lacks it."""
    try:
        return tuple(r[size]["share_ns_per_pair"] for r in (pair_caching, pair_mempool))
    except KeyError:
        return None


def process_bound(pair_caching, pair_mempool, size):
    """A pair's ratio were the allocator's share nil: the median of the mempool process's 0
    B rounds timed after its rounds of `size`, over its PyTorch partner's median at `size`.
    The 0 B call runs the same Python, dispatch and tensor code with no allocation, so this
    is how far that process's own pace (the same CPU, the same minutes) lets any allocator
    bring the pair; the pair's ratio less it is what the pool's allocate and free add. None
    where either process lacks the rounds."""
    try:
        floor = statistics.median(pair_mempool[size]["floor_rounds"])
        return floor / pair_caching[size]["ns_per_pair"]
    except (KeyError, statistics.StatisticsError):
        return None


def worst_over_median(te, size):
    """The slowest mempool process's ns at `size` over the median of PyTorch's processes
    (each allocator's figure as the README states it: the median and the worst process).
    None when either side has no process with that size."""
    mine = [r[size]["ns_per_pair"] for r in te["mempool"] if size in r]
    theirs = [r[size]["ns_per_pair"] for r in te["caching"] if size in r]
    if not mine or not theirs:
        return None
    return max(mine) / statistics.median(theirs)


def run_empty(outdir, procs=6, rounds=15, pairs=2000, controls=(), on_pair=None):
    """torch.empty + drop: `procs` pairs of processes, one of each allocator, each pair's
    two children at once on one CPU (the fastest just before they start), their rounds
    interleaved (bench/empty_pairs.py says why). Before, children ran one after the other,
    each on the CPU fastest as it started, and the host's pace moved between them: one
    pair's mempool child ran where an empty loop took 25-29 ns, another pair's PyTorch
    child where it took 12-15 (an earlier run (bench/results/ in git history)). on_pair(results)
    is called after every pair, mixed or control, so a run cut short keeps its pairs."""
    import empty_pairs

    child = os.path.join(ROOT, "mempool", "bench", "torch_empty_child.py")
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    results = {"caching": [], "mempool": [], "cpus": [], "ratios": []}
    kept = on_pair or (lambda results: None)
    for _ in range(procs):
        cpu, paces, pair = empty_pair_on_fastest_cpu(
            {name: [child, name, "--lockstep", str(pairs)] for name in ("caching", "mempool")},
            rounds, env)
        if "error" in pair:
            results["caching"].append(pair)
            results["mempool"].append(dict(pair))
            kept(results)
            continue
        for name in ("caching", "mempool"):
            r = dict(pair[name]["result"])
            for size in EMPTY_SIZES:
                r[str(size)] = {"ns_per_pair": pair[name]["ns_per_pair"][size],
                                "rounds": pair[name]["rounds"][size]}
                if size in pair[name].get("share_per_pair", {}):
                    r[str(size)]["share_ns_per_pair"] = pair[name]["share_per_pair"][size]
                    r[str(size)]["floor_rounds"] = pair[name]["floor_rounds"][size]
            r["cpu"], r["cpu_pace_ns"] = cpu, paces[cpu]
            results[name].append(r)
        results["ratios"].append({str(size): empty_pairs.round_ratios(
            pair["caching"]["rounds"][size], pair["mempool"]["rounds"][size])
            for size in EMPTY_SIZES})
        results["cpus"].append({"cpu": cpu, "paces": paces})
        kept(results)
    for name in controls:
        results.setdefault("control", {})[name] = []
        run_empty_control(child, env, name, procs, rounds, pairs,
                          out=results["control"][name], on_pair=lambda: kept(results))
    return results


def run_empty_control(child, env, name, procs, rounds, pairs, out=None, on_pair=None):
    """The same pairs with one allocator on both sides (an A/A control): how far two
    processes of one allocator, side by side on one CPU, differ from each other. Per pair,
    the second child's median ns over the first's for each size, as the mixed pairs' ratio;
    what a per-process target can resolve is bounded by this spread. Each pair is appended
    to `out` (a new list if None, returned) and on_pair() called after it."""
    out = [] if out is None else out
    for _ in range(procs):
        argv = [child, name, "--lockstep", str(pairs)]
        cpu, _paces, pair = empty_pair_on_fastest_cpu({"a": argv, "b": list(argv)}, rounds, env)
        if "error" in pair:
            out.append(pair)
        else:
            out.append({"cpu": cpu, **{str(size): pair["b"]["ns_per_pair"][size] /
                                       pair["a"]["ns_per_pair"][size] for size in EMPTY_SIZES}})
        if on_pair:
            on_pair()
    return out


def empty_pair_on_fastest_cpu(children, rounds, env):
    """(cpu, every CPU's pace, empty_pairs.run_pair's result) for one pair of children on
    the CPU fastest just before they start; the result is {"error": ...} when a child
    failed."""
    import empty_pairs

    (cpu,), paces = fastest_cpus(1)
    try:
        return cpu, paces, empty_pairs.run_pair(children, cpu, EMPTY_SIZES, rounds, env,
                                                floor=EMPTY_FLOOR)
    except RuntimeError as e:
        return cpu, paces, {"error": str(e)}


def summarize(rows):
    by = {}
    for r in rows:
        by.setdefault((r.get("workload"), r.get("allocator")), []).append(r)
    lines = ["| workload | allocator | ms/step (runs) | peak reserved GiB | peak allocated GiB | "
             "largest batch | first/last value |", "|---|---|---|---|---|---|---|"]
    for (w, a), rs in sorted(by.items(), key=lambda kv: (str(kv[0][0]), ALLOCATORS.index(kv[0][1]) if kv[0][1] in ALLOCATORS else 9)):
        ms = ", ".join(f"{r['ms_per_step']:.2f}" for r in rs if r.get("ms_per_step"))
        peak = ", ".join(f"{r['peak_reserved'] / (1 << 30):.2f}" for r in rs if "peak_reserved" in r)
        live = ", ".join(f"{r['peak_allocated'] / (1 << 30):.2f}" for r in rs
                         if "peak_allocated" in r)
        batch = ", ".join(str(r["largest_batch"]) for r in rs if "largest_batch" in r)
        vals = "; ".join(f"{r['values'][0]:.4f}/{r['values'][-1]:.4f}" for r in rs if r.get("values"))
        lines.append(f"| {w} | {a} | {ms} | {peak} | {live} | {batch} | {vals} |")
    return "\n".join(lines)


def compare_values(rows):
    """Per workload: the largest difference, over the steps, between PyTorch's two runs of
    its default allocator (its spread against itself), and between each other row and
    PyTorch's first run. Losses within PyTorch's own spread are PyTorch's."""
    lines = []
    for w in sorted({r.get("workload") for r in rows}):
        rs = [r for r in rows if r.get("workload") == w and r.get("values")]
        ref = [r for r in rs if r["allocator"] == "torch"]
        if not ref:
            continue

        def gap(a, b):
            n = min(len(a["values"]), len(b["values"]))
            return max(abs(x - y) for x, y in zip(a["values"][:n], b["values"][:n]))
        spread = f"{gap(ref[0], ref[1]):.2e}" if len(ref) > 1 else "one run"
        others = ", ".join(f"{r['allocator']} {gap(r, ref[0]):.2e}" for r in rs
                           if r is not ref[0] and not (len(ref) > 1 and r is ref[1]))
        lines.append(f"{w}: largest step difference, PyTorch against itself {spread}; "
                     f"against PyTorch's first run: {others}")
    return "\n".join(lines)


def print_empty_summary(te):
    """The torch.empty lines of a run: each allocator's median and worst process, each
    process, then per size the pairs' ratios, what a nil allocator share would give, the
    allocator's own ns, the controls and the rounds."""
    for name in ("caching", "mempool"):
        rs = te[name]
        for size in map(str, EMPTY_SIZES):
            vals = [r[size]["ns_per_pair"] for r in rs if size in r]
            if vals:
                print(f"torch.empty {name} {size} B: median {statistics.median(vals):.0f} ns, "
                      f"worst {max(vals):.0f} ns over {len(vals)} processes")
    for name in ("caching", "mempool"):
        for i, r in enumerate(te[name]):
            if "error" in r:
                print(f"torch.empty {name} process {i + 1}: {r['error']}")
                continue
            sizes = "; ".join(f"{size} B {r[size]['ns_per_pair']:.0f} ns"
                              for size in map(str, EMPTY_SIZES) if size in r)
            print(f"torch.empty {name} process {i + 1} on CPU {r.get('cpu')} (empty loop "
                  f"{r.get('cpu_pace_ns', float('nan')):.1f} ns): {sizes}")
    # The two children of a pair ran side by side on one CPU: their ratio is the fair one.
    for size in map(str, EMPTY_SIZES):
        ratios = [m[size]["ns_per_pair"] / c[size]["ns_per_pair"]
                  for m, c in zip(te["mempool"], te["caching"]) if size in m and size in c]
        if ratios:
            print(f"torch.empty {size} B, mempool / caching per pair of processes: "
                  + ", ".join(f"{r:.2f}" for r in ratios) + f" (worst {max(ratios):.2f})")
        bounds = [process_bound(c, m, size) for m, c in zip(te["mempool"], te["caching"])]
        bounds = [b for b in bounds if b is not None]
        if bounds:
            print(f"torch.empty {size} B, per pair with no allocator cost (the mempool "
                  "process's 0 B rounds over its partner's rounds at this size): "
                  + ", ".join(f"{b:.2f}" for b in bounds) + f" (worst {max(bounds):.2f})")
        worst = worst_over_median(te, size)
        if worst is not None:
            print(f"torch.empty {size} B, the slowest mempool process over PyTorch's "
                  f"median process: {worst:.2f}")
        shares = [allocator_shares(c, m, size) for m, c in zip(te["mempool"], te["caching"])]
        shares = [s for s in shares if s and size != "0"]
        if shares:
            print(f"torch.empty {size} B, the allocator's own ns (each round less the "
                  "0 B round after it, median) per pair, "
                  "PyTorch / mempool: " + ", ".join(f"{c:.0f} / {m:.0f}" for c, m in shares))
        for name, pairs in te.get("control", {}).items():
            spread = [r[size] for r in pairs if size in r]
            if spread:
                print(f"torch.empty {size} B, {name} / {name} per pair of processes (the "
                      "control: one allocator on both sides): "
                      + ", ".join(f"{r:.2f}" for r in spread)
                      + f" (from {min(spread):.2f} to {max(spread):.2f})")
        per_round = [x for pair in te.get("ratios", []) for x in pair.get(size, [])]
        if per_round:
            print(f"torch.empty {size} B, mempool / caching round by round: median "
                  f"{statistics.median(per_round):.2f}, worst {max(per_round):.2f} "
                  f"over {len(per_round)} rounds")


def summarize_saved_empty(path):
    """--empty-summary: the torch.empty lines of a saved run; 2 with a message on stderr when
    the file cannot be read or holds no torch.empty pairs."""
    try:
        with open(path) as f:
            te = json.load(f).get("torch_empty")
    except (OSError, ValueError) as e:
        print(f"--empty-summary: cannot read {path}: {e}", file=sys.stderr)
        return 2
    if not isinstance(te, dict) or not te.get("caching") or not te.get("mempool"):
        print(f"--empty-summary: {path} holds no torch.empty pairs (run with --workloads "
              "empty to make them)", file=sys.stderr)
        return 2
    print_empty_summary(te)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workloads", default="gpt,gpt-bucketed,resnet,infer,batch,empty")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "ALLOCATOR"))
    ap.add_argument("--snapshot", action="store_true",
                    help="record each child's allocations (torch.cuda.memory._record_memory_"
                         "history) into OUTDIR/snapshot-WORKLOAD-ALLOCATOR-N.pickle.gz, for "
                         "`python -m mempool replay`; its times are not comparable")
    ap.add_argument("--snapshot-path", help=argparse.SUPPRESS)   # the child's file
    ap.add_argument("--empty-control", default="", metavar="ALLOCATORS",
                    help="after the empty workload's pairs, as many pairs of one allocator "
                         "against itself, for each of these (caching, mempool): the spread "
                         "between two processes of one allocator")
    ap.add_argument("--empty-summary", metavar="JSON",
                    help="print the torch.empty lines of a run's workloads.json again (with "
                         "what this version derives from its rounds), and run nothing")
    ap.add_argument("--order-seed", type=int, default=1,
                    help="seed of the bucketed workloads' order of timed steps (1)")
    ap.add_argument("--batch-cap-gib", type=float, default=batch_workloads.DEFAULT_CAP_GIB,
                    metavar="GIB",
                    help="the memory cap of the largest-batch workloads (" +
                         ", ".join(batch_workloads.WORKLOADS) +
                         f"), in GiB (default {batch_workloads.DEFAULT_CAP_GIB:g})")
    args = ap.parse_args(argv)
    if not args.batch_cap_gib > 0:
        ap.error(f"--batch-cap-gib: takes a size in GiB above 0; got {args.batch_cap_gib:g}")
    global ORDER_SEED, BATCH_CAP_GIB
    ORDER_SEED, BATCH_CAP_GIB = args.order_seed, args.batch_cap_gib
    if args.child:
        return child(args.child[0], args.child[1], args.steps, args.snapshot_path)
    if args.empty_summary:
        return summarize_saved_empty(args.empty_summary)
    controls = [c for c in args.empty_control.split(",") if c]
    if set(controls) - {"caching", "mempool"}:
        ap.error(f"--empty-control: takes caching and/or mempool; got {args.empty_control!r}")
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS and w != "empty"]
    if unknown:   # an unknown name would otherwise fail in each child, one after the other
        ap.error(f"--workloads: unknown {', '.join(unknown)}; known: "
                 f"{', '.join(sorted([*WORKLOADS, 'empty']))}")
    if not args.outdir:
        ap.error("OUTDIR is needed to run workloads")
    allocators = args.allocators.split(",")
    known = set(ALLOCATORS) | set(TORCH_CONFS) | set(MEMPOOL_OPTIONS)
    unknown = [a for a in allocators if a not in known]
    if unknown:   # an unknown name would otherwise run PyTorch's own allocator under it
        ap.error(f"--allocators: unknown {', '.join(unknown)}; known: "
                 f"{', '.join(sorted(known))}")
    os.makedirs(args.outdir, exist_ok=True)
    rows, extra = [], {}

    def save():
        # After every row, so a run cut at its time limit keeps what it measured.
        with open(os.path.join(args.outdir, "workloads.json"), "w") as f:
            json.dump({"rows": rows, **extra}, f, indent=1)

    for w in workloads:
        if w == "empty":
            def keep_empty(results):   # after every pair, as save() after every row
                extra["torch_empty"] = results
                save()
            keep_empty(run_empty(args.outdir, controls=controls, on_pair=keep_empty))
            continue
        reps = 1 if w in batch_workloads.WORKLOADS or w == "infer" else args.reps
        for rep in range(reps):
            for a in allocators:     # alternating: rep 1 of each, then rep 2 of each
                cpus, paces = (fastest_cpus(WORKLOAD_CPUS) if w in PINNED_WORKLOADS
                               else (None, {}))
                seed = f"-seed{args.order_seed}" if args.order_seed != 1 else ""
                snap = ["--snapshot-path", os.path.join(
                    args.outdir, f"snapshot-{w}{seed}-{a}-{rep + 1}.pickle.gz")] if args.snapshot else []
                r = spawn([__file__, "--child", w, a, "--steps", str(args.steps),
                           "--order-seed", str(args.order_seed),
                           "--batch-cap-gib", repr(args.batch_cap_gib), *snap],
                          allocator_env(a), cpus=cpus)
                if cpus:
                    r["cpus"] = sorted(cpus)
                    r["cpu_paces_ns"] = [round(paces[c], 1) for c in sorted(cpus)]
                r.setdefault("workload", w)
                r.setdefault("allocator", a)
                rows.append(r)
                shown = {k: v for k, v in r.items() if k != "values"}
                if r.get("values"):
                    shown["last_value"] = r["values"][-1]   # the loss or output compared
                print(w, a, shown, flush=True)
                save()
    save()
    print(summarize([r for r in rows if "error" not in r]))
    print(compare_values([r for r in rows if "error" not in r]))
    batches = batch_workloads.side_by_side(rows, allocators)
    if batches:
        print(batches)
    for r in rows:
        if r.get("timed_steps_counters"):
            print(f"{r['workload']} {r['allocator']}: steps {r['ms_min']:.2f}-{r['ms_max']:.2f} ms; "
                  f"over the timed steps {r['timed_steps_counters']}")
    if "torch_empty" in extra:
        print_empty_summary(extra["torch_empty"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
