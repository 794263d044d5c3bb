"""Generate the allocation traces shipped in mempool/traces/ (seeded: the same files every run).

    python bench/make_traces.py            # write the traces, print what they hold
    python bench/make_traces.py --check    # regenerate in memory, compare with the files

Each trace models what a framework's caching allocator sees from one training loop: tensors
as allocs and frees with their exact byte sizes, in the order autograd creates and releases
them. Nothing is measured on a device; the models below say which tensors exist when.

- ``transformer_train.jsonl.gz``: a GPT-style model (12 layers, hidden 1024, 16 heads,
  batch 16) trained with mixed precision and Adam, the sequence length drawn per step from
  48..512. fp32 weights; Adam's state created at the first step; bf16 weight casts and
  activations saved per layer in forward and released in reverse order in backward;
  attention scores that grow with L**2; temporary workspaces; fp32 gradients created in
  backward and dropped by ``zero_grad(set_to_none=True)``.
- ``vision_train.jsonl.gz``: a ResNet-50-style CNN trained with SGD and momentum on batches
  of 32 images whose resolution changes per step (160..320 px, multiples of 32), with
  convolution workspaces that vary with the resolution and inputs copied on a side stream.
- ``small.jsonl``: a two-layer transformer, a few thousand events, for tests and demos.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mempool._units import format_bytes  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402
from mempool.cli.trace import TRACES_DIR  # noqa: E402

OUT_DIR = TRACES_DIR
BF16, FP32 = 2, 4
MiB = 1 << 20


class Recorder:
    """Hands out tensor ids and records events; time advances by a crude cost model (a fixed
    launch cost plus bytes touched at ~2 TB/s) so plots have a plausible time axis."""

    def __init__(self):
        self.events = []
        self.next_id = 1
        self.t = 0
        self.live = {}
        self.steps = []       # index of each training step's first event (meta step_starts)

    def step(self) -> None:
        self.steps.append(len(self.events))

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        nbytes = int(nbytes)
        assert nbytes > 0, nbytes
        ident = self.next_id
        self.next_id += 1
        self.live[ident] = nbytes
        self.events.append(mtrace.Event("alloc", ident, nbytes, stream, self.t))
        self.t += 3000 + nbytes // 2000
        return ident

    def free(self, ident: int, stream: int = 0) -> None:
        nbytes = self.live.pop(ident)
        self.events.append(mtrace.Event("free", ident, nbytes, stream, self.t))
        self.t += 1000

    def free_all(self, idents) -> None:
        for ident in idents:
            self.free(ident)

    def temp(self, nbytes: int) -> None:
        """A workspace used by one kernel and released right after."""
        self.free(self.alloc(nbytes))

    def live_bytes(self) -> int:
        return sum(self.live.values())


# ---------------------------------------------------------------------------------------
# transformer


def transformer(seed=1, steps=14, layers=12, hidden=1024, heads=16, batch=16, vocab=32000,
                lengths=(48, 512), max_positions=1024) -> mtrace.Trace:
    rng = random.Random(seed)
    r = Recorder()
    h, ffn = hidden, 4 * hidden

    # Persistent fp32 weights, one tensor per parameter, as nn.Module creates them.
    shapes = [vocab * h, max_positions * h]                     # token and position embedding
    for _ in range(layers):
        shapes += [h, h, 3 * h * h, 3 * h, h * h, h, h, h, ffn * h, ffn, h * ffn, h]
    shapes += [h, h]                                            # final layer norm
    weights = [r.alloc(n * FP32) for n in shapes]
    # The matmul weights of each layer, which autocast casts to bf16 in forward.
    per_layer = 12
    matmul_idx = [2, 4, 8, 10]
    adam = None
    grads = None
    for step in range(steps):
        r.step()
        L = rng.randint(*lengths)
        T = batch * L
        # Input ids and targets (int64), copied from the host.
        inputs = [r.alloc(T * 8), r.alloc(T * 8)]
        if grads is not None:
            r.free_all(grads)                                   # zero_grad(set_to_none=True)
            grads = None
        # ---- forward: x = embed(tokens) + pos
        emb = r.alloc(T * h * FP32)
        x = r.alloc(T * h * BF16)
        r.free(emb)
        saved = []                                              # per layer, in order
        for layer in range(layers):
            s = []
            base = 2 + layer * per_layer
            casts = [r.alloc(shapes[base + i] * BF16) for i in matmul_idx]
            s += casts
            s.append(x)                                         # residual input, kept by LN
            s.append(r.alloc(T * 2 * FP32))                     # LN mean, rstd
            ln1 = r.alloc(T * h * BF16); s.append(ln1)
            qkv = r.alloc(T * 3 * h * BF16); s.append(qkv)
            scores = r.alloc(batch * heads * L * L * FP32)      # QK^T, upcast for softmax
            probs = r.alloc(batch * heads * L * L * BF16); s.append(probs)
            r.free(scores)
            ctx = r.alloc(T * h * BF16); s.append(ctx)
            r.temp(min(32 * MiB, T * h * BF16))                 # cuBLAS split-K workspace
            proj = r.alloc(T * h * BF16)
            x1 = r.alloc(T * h * BF16); s.append(x1)            # residual add
            r.free(proj)
            s.append(r.alloc(T * 2 * FP32))
            ln2 = r.alloc(T * h * BF16); s.append(ln2)
            fc1 = r.alloc(T * ffn * BF16); s.append(fc1)
            act = r.alloc(T * ffn * BF16); s.append(act)
            r.temp(min(32 * MiB, T * ffn * BF16 // 4))
            fc2 = r.alloc(T * h * BF16)
            x = r.alloc(T * h * BF16)
            r.free(fc2)
            saved.append(s)
        lnf_stats = r.alloc(T * 2 * FP32)
        xf = r.alloc(T * h * BF16)
        logits = r.alloc(T * vocab * BF16)                      # tied output projection
        # Fused cross-entropy: fp32 log-softmax in chunks of 1/8 of the tokens, not kept.
        for _ in range(8):
            r.temp(T * vocab * FP32 // 8)
        loss = r.alloc(FP32)
        # ---- backward: the logits' gradient, then the output projection's
        dlogits = r.alloc(T * vocab * BF16)
        r.free(logits)
        grads = [None] * len(shapes)
        dW = r.alloc(vocab * h * BF16)
        grads[0] = r.alloc(vocab * h * FP32)
        r.free(dW)
        dxf = r.alloc(T * h * BF16)
        r.free(dlogits)
        r.free(xf)
        dx = r.alloc(T * h * BF16)
        r.free(dxf)
        r.free(lnf_stats)
        grads[-2] = r.alloc(h * FP32)
        grads[-1] = r.alloc(h * FP32)
        r.free(x)
        for layer in reversed(range(layers)):
            s = saved[layer]
            base = 2 + layer * per_layer
            (c_qkv, c_proj, c_fc1, c_fc2, x_in, st1, ln1, qkv, probs, ctx, x1, st2,
             ln2, fc1, act) = s
            layer_grads = {}

            def wgrad(i, cast=None):
                # bf16 weight gradient, accumulated into the fp32 .grad it creates.
                n = shapes[base + i]
                tmp = r.alloc(n * BF16)
                layer_grads[i] = r.alloc(n * FP32)
                r.free(tmp)
                if cast is not None:
                    r.free(cast)

            # MLP: fc2, gelu, fc1, ln2
            wgrad(10, c_fc2); layer_grads[11] = r.alloc(h * FP32)
            dact = r.alloc(T * ffn * BF16); r.free(act)
            dfc1 = r.alloc(T * ffn * BF16); r.free(dact); r.free(fc1)
            wgrad(8, c_fc1); layer_grads[9] = r.alloc(ffn * FP32)
            dln2 = r.alloc(T * h * BF16); r.free(dfc1); r.free(ln2)
            r.temp(T * h * FP32)                                # LN backward partials
            layer_grads[6] = r.alloc(h * FP32); layer_grads[7] = r.alloc(h * FP32)
            dx1 = r.alloc(T * h * BF16); r.free(dln2); r.free(st2)
            r.free(dx)
            # attention: proj, attention core, qkv, ln1
            r.free(x1)
            wgrad(4, c_proj); layer_grads[5] = r.alloc(h * FP32)
            dctx = r.alloc(T * h * BF16); r.free(ctx)
            dprobs = r.alloc(batch * heads * L * L * BF16)
            dscores = r.alloc(batch * heads * L * L * FP32)
            r.free(dprobs); r.free(probs)
            dqkv = r.alloc(T * 3 * h * BF16); r.free(dscores); r.free(dctx); r.free(qkv)
            wgrad(2, c_qkv); layer_grads[3] = r.alloc(3 * h * FP32)
            dln1 = r.alloc(T * h * BF16); r.free(dqkv); r.free(ln1)
            r.temp(T * h * FP32)
            layer_grads[0] = r.alloc(h * FP32); layer_grads[1] = r.alloc(h * FP32)
            dx = r.alloc(T * h * BF16); r.free(dln1); r.free(st1)
            r.free(dx1)
            r.free(x_in)
            for i, g in layer_grads.items():
                grads[base + i] = g
        # position and token embedding gradients (index_add into fp32)
        grads[1] = r.alloc(max_positions * h * FP32)
        tmp = r.alloc(T * h * FP32)
        r.free(tmp)
        r.free(dx)
        r.free(loss)
        r.free_all(inputs)
        # ---- optimizer: Adam's state on the first step, foreach temporaries every step
        if adam is None:
            adam = [r.alloc(n * FP32) for n in shapes] + [r.alloc(n * FP32) for n in shapes]
        chunk = 24                                              # tensors per foreach launch
        for i in range(0, len(shapes), chunk):
            temps = [r.alloc(n * FP32) for n in shapes[i:i + chunk]]
            r.free_all(temps)
    # End of training: drop the last gradients, Adam's state and the weights.
    r.free_all(grads)
    r.free_all(adam)
    r.free_all(weights)
    return mtrace.Trace(r.events, {
        "source": "bench/make_traces.py",
        "description": f"transformer training, {layers} layers, hidden {hidden}, {heads} heads, "
                       f"batch {batch}, sequence length {lengths[0]}..{lengths[1]} per step, "
                       f"{steps} steps, mixed precision, Adam",
        "seed": seed,
        "step_starts": r.steps,
    })


# ---------------------------------------------------------------------------------------
# vision


def vision(seed=2, steps=20, batch=32, resolutions=range(160, 321, 32), classes=1000,
           blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512)) -> mtrace.Trace:
    rng = random.Random(seed)
    r = Recorder()
    COPY_STREAM = 1

    # Parameters: stem conv, bottleneck convs (1x1, 3x3, 1x1, optional downsample), BN, fc.
    params = [64 * 3 * 7 * 7, 64, 64]
    layout = []                                                # (cin, width, cout, stride)
    cin = 64
    for stage, (n, w) in enumerate(zip(blocks, widths)):
        for b in range(n):
            stride = 2 if (b == 0 and stage > 0) else 1
            cout = 4 * w
            layout.append((cin, w, cout, stride, b == 0))
            params += [w * cin, w, w, w * w * 9, w, w, cout * w, cout, cout]
            if b == 0:
                params += [cout * cin, cout, cout]
            cin = cout
    params += [classes * cin, classes]
    weights = [r.alloc(n * FP32) for n in params]
    momentum = None
    grads = None
    for step in range(steps):
        r.step()
        res = rng.choice(list(resolutions))
        B = batch
        # Input batch: pinned host -> device on the copy stream, then used on stream 0.
        images = r.alloc(B * 3 * res * res * FP32, stream=COPY_STREAM)
        labels = r.alloc(B * 8, stream=COPY_STREAM)
        if grads is not None:
            r.free_all(grads)
            grads = None
        x = r.alloc(B * 3 * res * res * BF16)                   # autocast input cast
        saved = []
        # stem: conv 7x7/2, bn, relu, maxpool
        hw = res // 2
        r.temp(_conv_ws(B, 64, hw, 7, rng))
        c = r.alloc(B * 64 * hw * hw * BF16)
        bn = r.alloc(B * 64 * hw * hw * BF16)
        relu = r.alloc(B * 64 * hw * hw * BF16)
        hw //= 2
        pool = r.alloc(B * 64 * hw * hw * BF16)
        saved.append([x, c, bn, relu])
        x = pool
        for (ci, w, co, stride, down) in layout:
            s = [x]
            out_hw = hw // stride
            a = r.alloc(B * w * hw * hw * BF16); s.append(a)                 # conv1 1x1
            s.append(r.alloc(B * w * hw * hw * BF16))                        # bn1
            s.append(r.alloc(B * w * hw * hw * BF16))                        # relu1
            r.temp(_conv_ws(B, w, out_hw, 3, rng))
            s.append(r.alloc(B * w * out_hw * out_hw * BF16))                # conv2 3x3
            s.append(r.alloc(B * w * out_hw * out_hw * BF16))                # bn2
            s.append(r.alloc(B * w * out_hw * out_hw * BF16))                # relu2
            s.append(r.alloc(B * co * out_hw * out_hw * BF16))               # conv3 1x1
            s.append(r.alloc(B * co * out_hw * out_hw * BF16))               # bn3
            if down:
                s.append(r.alloc(B * co * out_hw * out_hw * BF16))           # downsample conv
                s.append(r.alloc(B * co * out_hw * out_hw * BF16))           # downsample bn
            x = r.alloc(B * co * out_hw * out_hw * BF16)                     # add + relu
            hw = out_hw
            saved.append(s)
        pooled = r.alloc(B * cin * BF16)
        logits = r.alloc(B * classes * BF16)
        loss = r.alloc(FP32)
        # backward
        grads = [None] * len(params)
        gi = len(params) - 1
        dlog = r.alloc(B * classes * FP32)
        grads[gi] = r.alloc(params[gi] * FP32); gi -= 1
        grads[gi] = r.alloc(params[gi] * FP32); gi -= 1
        dpool = r.alloc(B * cin * BF16)
        r.free(dlog); r.free(logits); r.free(pooled); r.free(loss)
        dx = r.alloc(B * cin * hw * hw * BF16)
        r.free(dpool)
        r.free(x)
        for (ci, w, co, stride, down), s in zip(reversed(layout), reversed(saved[1:])):
            in_hw = hw * stride
            n_params = 9 + (3 if down else 0)
            first = gi - n_params + 1
            for j in range(n_params):
                grads[first + j] = None
            # through the block, in reverse: a gradient per saved tensor, a weight gradient
            # per conv, a workspace per 3x3 conv.
            block_params = list(range(first, gi + 1))
            d = dx
            for t in reversed(s[1:]):
                nd = r.alloc(r.live[t])
                r.free(d)
                r.free(t)
                d = nd
                if block_params and rng.random() < 0.6:
                    p = block_params.pop()
                    grads[p] = r.alloc(params[p] * FP32)
            r.temp(_conv_ws(B, w, hw, 3, rng))
            for p in block_params:
                grads[p] = r.alloc(params[p] * FP32)
            gi = first - 1
            dx = r.alloc(B * ci * in_hw * in_hw * BF16)
            r.free(d)
            r.free(s[0])
            hw = in_hw
        # stem backward
        for t in reversed(saved[0]):
            nd = r.alloc(r.live[t])
            r.free(dx)
            r.free(t)
            dx = nd
        r.temp(_conv_ws(B, 64, res // 2, 7, rng))
        for p in range(0, gi + 1):
            grads[p] = r.alloc(params[p] * FP32)
        r.free(dx)
        r.free(images, stream=COPY_STREAM)
        r.free(labels, stream=COPY_STREAM)
        if momentum is None:
            momentum = [r.alloc(n * FP32) for n in params]
        temps = [r.alloc(n * FP32) for n in params[:48]]
        r.free_all(temps)
    r.free_all(grads)
    r.free_all(momentum)
    r.free_all(weights)
    return mtrace.Trace(r.events, {
        "source": "bench/make_traces.py",
        "description": f"ResNet-50-style CNN training, batch {batch}, resolution "
                       f"{min(resolutions)}..{max(resolutions)} px per step, {steps} steps, "
                       "mixed precision, SGD with momentum, inputs copied on stream 1",
        "seed": seed,
        "step_starts": r.steps,
    })


def _conv_ws(batch, channels, hw, k, rng) -> int:
    """cuDNN-style workspace: grows with the output and the kernel, varies with the algorithm
    the heuristics pick (modelled as a seeded choice)."""
    base = batch * channels * hw * hw * BF16 * (k * k) // 16
    return max(1 * MiB, min(512 * MiB, int(base * rng.choice((0.25, 0.5, 1.0, 2.0)))))


# ---------------------------------------------------------------------------------------


def small() -> mtrace.Trace:
    t = transformer(seed=3, steps=12, layers=2, hidden=256, heads=4, batch=4, vocab=8000,
                    lengths=(32, 128), max_positions=256)
    t.meta["description"] = "small transformer training (2 layers, hidden 256), for tests"
    return t


def record_torch(out_path: str, seed=1, steps=14, layers=12, hidden=1024, heads=16, batch=16,
                 vocab=32000, lengths=(48, 512)) -> dict:
    """Record a real PyTorch training loop on a GPU (the same model and schedule as
    :func:`transformer`) with PyTorch's memory history, and save it as a mempool trace.

    Attention is written out (scores, softmax, weighted sum) so its buffers grow with L**2
    as in :func:`transformer`; bf16 autocast, Adam, ``zero_grad(set_to_none=True)``.
    Returns what PyTorch's allocator measured in the run.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    rng = random.Random(seed)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.proj = torch.nn.Linear(hidden, hidden)
            self.ln2 = torch.nn.LayerNorm(hidden)
            self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
            self.fc2 = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, heads, -1).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            mask = torch.ones(L, L, device=x.device, dtype=torch.bool).triu(1)
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            ctx = (probs @ v).transpose(1, 2).reshape(B, L, hidden)
            x = x + self.proj(ctx)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(vocab, hidden)
            self.wpe = torch.nn.Embedding(1024, hidden)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.lnf = torch.nn.LayerNorm(hidden)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            return self.lnf(x) @ self.wte.weight.t()

    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    model = GPT().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(steps):
        L = rng.randint(*lengths)
        idx = torch.randint(0, vocab, (batch, L), device="cuda")
        tgt = torch.randint(0, vocab, (batch, L), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx)
        loss = F.cross_entropy(logits.float().view(-1, vocab), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, loss, idx, tgt
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    tr = mtrace.from_torch_snapshot(snap)
    tr.meta.update(source="torch-snapshot", description=(
        f"PyTorch {torch.__version__} training loop recorded on {torch.cuda.get_device_name()}:"
        f" {layers} layers, hidden {hidden}, {heads} heads, batch {batch}, sequence length "
        f"{lengths[0]}..{lengths[1]} per step, {steps} steps, bf16 autocast, Adam"),
        seed=seed, torch_reserved_peak=stats["reserved_bytes.all.peak"],
        torch_allocated_peak=stats["allocated_bytes.all.peak"])
    mtrace.save(tr, out_path)
    return dict(tr.meta, events=len(tr))


TRACES = {
    "transformer_train.jsonl.gz": transformer,
    "vision_train.jsonl.gz": vision,
    "small.jsonl": small,
}


def _summary(name, events) -> str:
    live = peak = 0
    sizes = {}
    for ev in events:
        if ev.action == "alloc":
            sizes[ev.id] = ev.nbytes
            live += ev.nbytes
            peak = max(peak, live)
        else:
            live -= sizes.pop(ev.id)
    return f"{name:<28} {len(events):>7} events  peak live {format_bytes(peak):>10}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=OUT_DIR, help="where to write (default mempool/traces)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory and compare with the files instead of writing")
    ap.add_argument("--record-torch", metavar="FILE",
                    help="on a GPU: record a real PyTorch training loop into FILE and stop")
    args = ap.parse_args(argv)
    if args.record_torch:
        import json
        print(json.dumps(record_torch(args.record_torch), indent=2))
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    bad = 0
    for name, make in TRACES.items():
        events = make()
        path = os.path.join(args.out_dir, name)
        if args.check:
            same = os.path.exists(path) and list(mtrace.load(path)) == list(events)
            print(f"{_summary(name, events)}  {'matches' if same else 'DIFFERS from'} {path}")
            bad += not same
        else:
            mtrace.save(events, path)
            print(f"{_summary(name, events)}  {format_bytes(os.path.getsize(path)):>10}  {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
