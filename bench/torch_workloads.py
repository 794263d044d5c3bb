"""Real PyTorch workloads under four allocators, side by side, each run in a process of its own.

    python bench/torch_workloads.py OUTDIR [--steps 30] [--reps 2] [--workloads gpt,resnet,infer,batch,empty]

Workloads (model code from Hugging Face ``transformers`` and ``torchvision``, random
weights, built from a config; nothing here defines a model):
  gpt     a GPT-2 style decoder (8 layers, hidden 1024, 16 heads) trained with AdamW under
          bf16 autocast on batches of 8 sequences whose length changes every step (64-512);
  resnet  torchvision's ResNet-50 trained with SGD, ``torch.backends.cudnn.benchmark = True``;
  infer   the GPT model's forward under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs);
  batch   the largest batch of the GPT step (length 512) that fits under a fixed cap;
  empty   ``torch.empty`` + drop, in six processes per allocator, alternating.
Allocators: PyTorch's default, PyTorch with ``expandable_segments:True``, mempool's default
and mempool with expandable segments (``mempool.torch.install``). For each: ms per step
(median over the timed steps, after warm-up), peak reserved, and the losses or outputs, so
that mempool's can be compared with PyTorch's own spread between two runs. Writes
OUTDIR/workloads.json and prints a table. A benchmark, not a test: it asserts nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ALLOCATORS = ("torch", "torch-expandable", "mempool", "mempool-expandable")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---- the child: one workload under one allocator ------------------------------------------

def setup_allocator(name):
    import torch
    if name.startswith("mempool"):
        import mempool
        import mempool.torch as mt
        pool = mempool.Pool(backend="cuda", expandable_segments=name.endswith("expandable"))
        mt.install(pool, allocator="full")
    return torch


def gpt_model(torch):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=8, n_embd=1024, n_head=16, n_positions=512, vocab_size=32000,
                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return GPT2LMHeadModel(cfg).cuda()


def timed(torch, steps, warmup, body):
    times, values = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        v = body(i)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        values.append(v)
    return statistics.median(times), values


def run_gpt(torch, steps):
    import random
    model = gpt_model(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(1)
    lengths = [rng.randrange(64, 513) for _ in range(steps + 10)]
    g = torch.Generator(device="cuda").manual_seed(2)

    def step(i):
        ids = torch.randint(0, 32000, (8, lengths[i]), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    ms, losses = timed(torch, steps, 10, step)
    return {"ms_per_step": ms, "values": losses}


def run_resnet(torch, steps):
    import torchvision
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(2)

    def step(i):
        x = torch.randn(64, 3, 224, 224, device="cuda", generator=g)
        y = torch.randint(0, 1000, (64,), device="cuda", generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

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


def run_batch(torch, steps, cap_gib=24):
    """Largest GPT batch (length 512) whose step fits under cap_gib of memory."""
    frac = cap_gib * (1 << 30) / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(frac, 0)
    model = gpt_model(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def fits(batch):
        try:
            ids = torch.randint(0, 32000, (batch, 512), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            ids = loss = None
            opt.zero_grad(set_to_none=True)

    lo, hi = 0, 4
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"largest_batch": lo, "cap_gib": cap_gib, "ms_per_step": None, "values": []}


WORKLOADS = {"gpt": run_gpt, "resnet": run_resnet, "infer": run_infer, "batch": run_batch}


def child(workload, allocator, steps):
    torch = setup_allocator(allocator)
    t0 = time.time()
    out = WORKLOADS[workload](torch, steps)
    out.update(workload=workload, allocator=allocator, wall_s=round(time.time() - t0, 1),
               peak_reserved=torch.cuda.max_memory_reserved(),
               peak_allocated=torch.cuda.max_memory_allocated(),
               backend=torch.cuda.memory.get_allocator_backend())
    print("RESULT " + json.dumps(out))


# ---- the parent ------------------------------------------------------------------------

def spawn(args, env_extra=None, timeout=900, cpu=None):
    """Run a child of this script (or another) and return the JSON it prints. `cpu` pins the
    child to that CPU, so that children compared with each other run on the same core."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(env_extra or {})
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, preexec_fn=pin)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (done.stdout + done.stderr)[-3000:], "rc": done.returncode}


def allocator_env(name):
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if name == "torch-expandable" else {}


def run_empty(outdir, procs=6):
    """torch.empty + drop: six processes per allocator, alternating (torch_empty_child.py),
    every child pinned to one CPU: on a host whose cores run at two paces, unpinned children
    of either allocator landed on either pace, and a process's figure said more about its
    core than about its allocator."""
    cpu = max(os.sched_getaffinity(0))
    results = {"caching": [], "mempool": []}
    for _ in range(procs):
        for name in results:
            r = spawn([os.path.join(ROOT, "mempool", "bench", "torch_empty_child.py"), name,
                       "7", "2000", "512", "65536", "1048576", "67108864"], cpu=cpu)
            results[name].append(r)
    results["cpu"] = cpu
    return results


def summarize(rows):
    by = {}
    for r in rows:
        by.setdefault((r.get("workload"), r.get("allocator")), []).append(r)
    lines = ["| workload | allocator | ms/step (runs) | peak reserved GiB | largest batch | "
             "first/last value |", "|---|---|---|---|---|---|"]
    for (w, a), rs in sorted(by.items(), key=lambda kv: (str(kv[0][0]), ALLOCATORS.index(kv[0][1]) if kv[0][1] in ALLOCATORS else 9)):
        ms = ", ".join(f"{r['ms_per_step']:.2f}" for r in rs if r.get("ms_per_step"))
        peak = ", ".join(f"{r['peak_reserved'] / (1 << 30):.2f}" for r in rs if "peak_reserved" in r)
        batch = ", ".join(str(r["largest_batch"]) for r in rs if "largest_batch" in r)
        vals = "; ".join(f"{r['values'][0]:.4f}/{r['values'][-1]:.4f}" for r in rs if r.get("values"))
        lines.append(f"| {w} | {a} | {ms} | {peak} | {batch} | {vals} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workloads", default="gpt,resnet,infer,batch,empty")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "ALLOCATOR"))
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1], args.steps)
    os.makedirs(args.outdir, exist_ok=True)
    workloads = args.workloads.split(",")
    allocators = args.allocators.split(",")
    rows, extra = [], {}

    def save():
        # After every row, so a run cut at its time limit keeps what it measured.
        with open(os.path.join(args.outdir, "workloads.json"), "w") as f:
            json.dump({"rows": rows, **extra}, f, indent=1)

    for w in workloads:
        if w == "empty":
            extra["torch_empty"] = run_empty(args.outdir)
            save()
            continue
        reps = 1 if w in ("batch", "infer") else args.reps
        for _ in range(reps):
            for a in allocators:     # alternating: rep 1 of each, then rep 2 of each
                r = spawn([__file__, "--child", w, a, "--steps", str(args.steps)],
                          allocator_env(a))
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
    if "torch_empty" in extra:
        for name, rs in extra["torch_empty"].items():
            if name == "cpu":
                continue
            for size in ("512", "65536", "1048576", "67108864"):
                vals = [r[size]["ns_per_pair"] for r in rs if size in r]
                if vals:
                    print(f"torch.empty {name} {size} B: median {statistics.median(vals):.0f} ns, "
                          f"worst {max(vals):.0f} ns over {len(vals)} processes")
        # Child i of each allocator ran one after the other: their ratio is the fairest pair.
        te = extra["torch_empty"]
        for size in ("512", "65536", "1048576", "67108864"):
            ratios = [m[size]["ns_per_pair"] / c[size]["ns_per_pair"]
                      for m, c in zip(te["mempool"], te["caching"]) if size in m and size in c]
            if ratios:
                print(f"torch.empty {size} B, mempool / caching per pair of processes: "
                      + ", ".join(f"{r:.2f}" for r in ratios) + f" (worst {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
