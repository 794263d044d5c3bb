"""The workloads of the trace corpus: real model code, random weights, random data.

Each workload is a function ``run(device, tiny, mark)``: it builds its model from a config
(nothing is downloaded), runs a few steps on `device`, and calls ``mark()`` at the start of
every step, before the step allocates anything. ``tiny=True`` shrinks every size so that one
or two steps run on a CPU in seconds (``record.py --cpu-check``); the recorded sizes are the
defaults. Seeds are fixed, so a run allocates the same sizes every time on the same software.

The split into halves is fixed here, with each workload (``WORKLOADS``): the reasons are in
mempool/traces/corpus/README.md.
"""
from __future__ import annotations

import math
import random
from typing import Callable, NamedTuple

SEED = 0
# Bytes of the two allocations that mark a step's start in a recording (record.py makes
# them, convert.py takes them out): primes, so that no tensor, whose size is a multiple of
# its element size and mostly of a power of two, has them. Defined here, with nothing to
# import, so that a recording child needs no mempool.
MARKS = (4093, 8179)


class Workload(NamedTuple):
    name: str
    half: str             # "tuning" or "held-out"
    description: str
    run: Callable         # run(device, tiny, mark)
    needs: tuple          # modules it imports (a --cpu-check without one skips it)
    timeout_s: int        # the recording child's limit on the GPU machine


def _seed(torch):
    random.seed(SEED)
    torch.manual_seed(SEED)


def _autocast(torch, device):
    """bf16 autocast where the device takes it (a CPU check runs in fp32)."""
    if device == "cpu":
        import contextlib
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------
# Hugging Face BERT fine-tune: dynamic padding, activation checkpointing


def bert_finetune(device, tiny, mark):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    _seed(torch)
    if tiny:
        cfg = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64, num_labels=3)
        batch, lengths, steps = 2, (8, 24), 2
    else:
        cfg = BertConfig(num_labels=3)          # bert-base: 12 layers, hidden 768
        batch, lengths, steps = 32, (32, 512), 12
    model = BertForSequenceClassification(cfg).to(device)
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    for _ in range(steps):
        mark()
        # Dynamic padding: each batch padded to its longest sequence, rounded up to 8.
        seqs = [random.randint(*lengths) for _ in range(batch)]
        width = -(-max(seqs) // 8) * 8
        ids = torch.randint(1, cfg.vocab_size, (batch, width), device=device)
        mask = torch.zeros(batch, width, dtype=torch.long, device=device)
        for i, n in enumerate(seqs):
            mask[i, :n] = 1
        labels = torch.randint(0, cfg.num_labels, (batch,), device=device)
        with _autocast(torch, device):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()


# ------------------------------------------------------------------------------------------
# torchvision ResNet-50 training under cuDNN benchmark


def resnet50_train(device, tiny, mark):
    import torch
    import torchvision

    _seed(torch)
    torch.backends.cudnn.benchmark = True
    batch, size, steps = (2, 64, 2) if tiny else (64, 224, 10)
    model = torchvision.models.resnet50(weights=None).to(device)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        mark()
        x = torch.randn(batch, 3, size, size, device=device).to(
            memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)
        with _autocast(torch, device):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()


# ------------------------------------------------------------------------------------------
# a diffusion UNet training step, in plain torch


def _unet(torch, base, levels, tiny):
    nn = torch.nn
    F = torch.nn.functional

    class ResBlock(nn.Module):
        def __init__(self, cin, cout, temb):
            super().__init__()
            self.n1 = nn.GroupNorm(8 if not tiny else 2, cin)
            self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(temb, cout)
            self.n2 = nn.GroupNorm(8 if not tiny else 2, cout)
            self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(F.silu(self.n1(x)))
            h = h + self.t(t)[:, :, None, None]
            h = self.c2(F.silu(self.n2(h)))
            return h + self.skip(x)

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.norm = nn.GroupNorm(8 if not tiny else 2, c)
            self.qkv = nn.Linear(c, 3 * c)
            self.out = nn.Linear(c, c)
            self.heads = 8 if not tiny else 2

        def forward(self, x):
            b, c, h, w = x.shape
            y = self.norm(x).flatten(2).transpose(1, 2)
            q, k, v = self.qkv(y).view(b, h * w, 3, self.heads, c // self.heads).unbind(2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2))
            y = self.out(y.transpose(1, 2).reshape(b, h * w, c))
            return x + y.transpose(1, 2).reshape(b, c, h, w)

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            temb = base * 4
            self.temb = nn.Sequential(nn.Linear(base, temb), nn.SiLU(), nn.Linear(temb, temb))
            self.inp = nn.Conv2d(4, base, 3, padding=1)
            chans = [base * m for m in levels]
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            c = base
            skips = []
            for i, co in enumerate(chans):
                self.down.append(nn.ModuleList([ResBlock(c, co, temb), ResBlock(co, co, temb)]))
                skips.append(co)
                c = co
            self.mid = nn.ModuleList([ResBlock(c, c, temb), Attention(c), ResBlock(c, c, temb)])
            for co in reversed(chans):
                self.up.append(nn.ModuleList([ResBlock(c + skips.pop(), co, temb),
                                              ResBlock(co, co, temb)]))
                c = co
            self.outn = nn.GroupNorm(8 if not tiny else 2, c)
            self.out = nn.Conv2d(c, 4, 3, padding=1)
            self.base = base

        def forward(self, x, t):
            half = self.base // 2
            freqs = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
            emb = t[:, None].float() * freqs[None]
            t = self.temb(torch.cat([emb.sin(), emb.cos()], dim=1))
            h = self.inp(x)
            skips = []
            for i, (a, b) in enumerate(self.down):
                h = b(a(h, t), t)
                skips.append(h)
                if i < len(self.down) - 1:
                    h = F.avg_pool2d(h, 2)
            h = self.mid[2](self.mid[1](self.mid[0](h, t)), t)
            for i, (a, b) in enumerate(self.up):
                if i > 0:
                    h = F.interpolate(h, scale_factor=2, mode="nearest")
                h = b(a(torch.cat([h, skips.pop()], dim=1), t), t)
            return self.out(F.silu(self.outn(h)))

    return UNet()


def unet_diffusion(device, tiny, mark):
    import torch

    _seed(torch)
    if tiny:
        model, batch, res, steps = _unet(torch, 8, (1, 2), True), 2, 16, 2
    else:
        model, batch, res, steps = _unet(torch, 128, (1, 2, 4, 4), False), 16, 64, 10
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    betas = torch.linspace(1e-4, 0.02, 1000, device=device)
    alphas = torch.cumprod(1 - betas, dim=0)
    for _ in range(steps):
        mark()
        x0 = torch.randn(batch, 4, res, res, device=device)
        t = torch.randint(0, 1000, (batch,), device=device)
        noise = torch.randn_like(x0)
        a = alphas[t][:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with _autocast(torch, device):
            loss = torch.nn.functional.mse_loss(model(xt, t).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()


# ------------------------------------------------------------------------------------------
# GPT-2 serving: a growing KV cache, a batch and a prompt length that change per request


def gpt2_serving(device, tiny, mark):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    _seed(torch)
    if tiny:
        cfg = GPT2Config(vocab_size=1000, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                         bos_token_id=0, eos_token_id=0)
        batches, prompts, new, requests = (1, 3), (4, 16), (3, 5), 2
    else:
        # distilgpt2's shape (6 layers, hidden 768): each token decoded is ~40 allocations
        # and frees a layer, so that 8 requests fit a trace's size.
        cfg = GPT2Config(n_positions=1024, n_layer=6)
        batches, prompts, new, requests = (1, 32), (16, 512), (8, 24), 8
    dtype = torch.float32 if device == "cpu" else torch.float16
    model = GPT2LMHeadModel(cfg).to(device=device, dtype=dtype).eval()
    with torch.inference_mode():
        for _ in range(requests):
            mark()
            batch = random.randint(*batches)
            ids = torch.randint(0, cfg.vocab_size, (batch, random.randint(*prompts)),
                                device=device)
            out = model(input_ids=ids, use_cache=True)
            past, tokens = out.past_key_values, []
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(random.randint(*new)):
                tokens.append(nxt)
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cat(tokens, dim=1).cpu()
            del out, past, nxt, tokens


# ------------------------------------------------------------------------------------------
# a mixture-of-experts layer stack with uneven expert loads


def moe_train(device, tiny, mark):
    import torch
    nn = torch.nn
    F = torch.nn.functional

    _seed(torch)
    if tiny:
        d, ff, experts, layers, batch, seq, steps = 16, 32, 4, 2, 2, 8, 2
    else:
        d, ff, experts, layers, batch, seq, steps = 1024, 4096, 8, 4, 8, 512, 10

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(d, experts, bias=False)
            self.w1 = nn.ModuleList(nn.Linear(d, ff) for _ in range(experts))
            self.w2 = nn.ModuleList(nn.Linear(ff, d) for _ in range(experts))
            self.norm = nn.LayerNorm(d)
            self.skew = None            # per-expert logit bias: which experts are popular

        def forward(self, x):
            b, s, _ = x.shape
            flat = self.norm(x).reshape(b * s, d)
            logits = self.router(flat)
            if self.skew is not None:
                logits = logits + self.skew
            weight, chosen = logits.softmax(-1).topk(2, dim=-1)
            out = torch.zeros_like(flat)
            for e in range(experts):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                h = self.w2[e](F.gelu(self.w1[e](flat[rows])))
                out = out.index_add(0, rows, (h * weight[rows, slot, None]).to(out.dtype))
            return x + out.view(b, s, d)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(d, 8 if not tiny else 2, batch_first=True)
            self.norm = nn.LayerNorm(d)
            self.moe = MoE()

        def forward(self, x):
            y = self.norm(x)
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return self.moe(x)

    model = nn.Sequential(*[Block() for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        mark()
        # The popular experts change per step, as a router's preferences drift in training.
        for block in model:
            block.moe.skew = torch.randn(experts, device=device) * 2.0
        x = torch.randn(batch, seq, d, device=device)
        with _autocast(torch, device):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()


# ------------------------------------------------------------------------------------------
# torchvision Faster R-CNN training on images of varying sizes


def fasterrcnn_train(device, tiny, mark):
    import torch
    import torchvision

    _seed(torch)
    if tiny:
        kw, batch, sizes, steps = {"min_size": 64, "max_size": 96}, 1, (48, 96), 2
    else:
        kw, batch, sizes, steps = {"min_size": 512, "max_size": 896}, 4, (320, 1024), 8
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91, **kw).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        mark()
        images, targets = [], []
        for _ in range(batch):
            h, w = random.randint(*sizes), random.randint(*sizes)
            images.append(torch.rand(3, h, w, device=device))
            n = random.randint(1, 12)
            xy = torch.rand(n, 2, device=device) * torch.tensor([w * 0.7, h * 0.7],
                                                                device=device)
            wh = torch.rand(n, 2, device=device) * torch.tensor([w * 0.3, h * 0.3],
                                                                device=device) + 4
            targets.append({"boxes": torch.cat([xy, xy + wh], dim=1),
                            "labels": torch.randint(1, 91, (n,), device=device)})
        losses = model(images, targets)
        loss = sum(losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()


# ------------------------------------------------------------------------------------------
# a small-tensor reinforcement-learning loop (PPO-style, vectorised environments on the GPU)


def rl_ppo(device, tiny, mark):
    import torch
    nn = torch.nn

    _seed(torch)
    envs, obs_dim, acts, horizon, iters, epochs, minibatches = (
        (4, 8, 3, 8, 2, 1, 2) if tiny else (64, 32, 6, 64, 8, 2, 4))
    policy = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                           nn.Linear(256, acts + 1)).to(device)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-4)
    dynamics = torch.randn(acts, obs_dim, obs_dim, device=device) * 0.1
    obs = torch.randn(envs, obs_dim, device=device)
    for _ in range(iters):
        mark()
        buf = {k: [] for k in ("obs", "act", "logp", "val", "rew", "done")}
        with torch.no_grad():
            for _ in range(horizon):
                out = policy(obs)
                dist = torch.distributions.Categorical(logits=out[:, :acts])
                act = dist.sample()
                buf["obs"].append(obs)
                buf["act"].append(act)
                buf["logp"].append(dist.log_prob(act))
                buf["val"].append(out[:, acts])
                # The environment step: a small tensor program per step, as a simulator's.
                obs = torch.tanh(torch.bmm(dynamics[act], obs[:, :, None])[:, :, 0]
                                 + 0.1 * torch.randn_like(obs))
                rew = -obs.pow(2).mean(1)
                done = torch.rand(envs, device=device) < 0.01
                obs = torch.where(done[:, None], torch.randn_like(obs), obs)
                buf["rew"].append(rew)
                buf["done"].append(done.float())
            last = policy(obs)[:, acts]
        data = {k: torch.stack(v) for k, v in buf.items()}
        # Generalised advantage estimation, one small step per time step.
        adv = torch.zeros_like(data["rew"])
        gae = torch.zeros(envs, device=device)
        for t in reversed(range(horizon)):
            nxt = last if t == horizon - 1 else data["val"][t + 1]
            delta = data["rew"][t] + 0.99 * nxt * (1 - data["done"][t]) - data["val"][t]
            gae = delta + 0.99 * 0.95 * (1 - data["done"][t]) * gae
            adv[t] = gae
        ret = adv + data["val"]
        flat = {k: v.reshape(horizon * envs, *v.shape[2:]) for k, v in data.items()}
        adv, ret = adv.reshape(-1), ret.reshape(-1)
        for _ in range(epochs):
            perm = torch.randperm(horizon * envs, device=device)
            for idx in perm.chunk(minibatches):
                out = policy(flat["obs"][idx])
                dist = torch.distributions.Categorical(logits=out[:, :acts])
                ratio = (dist.log_prob(flat["act"][idx]) - flat["logp"][idx]).exp()
                a = (adv[idx] - adv[idx].mean()) / (adv[idx].std() + 1e-8)
                loss = (-torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
                        + 0.5 * (out[:, acts] - ret[idx]).pow(2).mean()
                        - 0.01 * dist.entropy().mean())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        loss.item()


# ------------------------------------------------------------------------------------------
# a graph network on graphs of varying size (message passing with index_add, plain torch)


def gnn_train(device, tiny, mark):
    import torch
    nn = torch.nn

    _seed(torch)
    feat, hidden, classes, layers = (8, 16, 3, 2) if tiny else (128, 256, 16, 3)
    nodes, degree, steps = ((20, 60), (2, 5), 2) if tiny else ((20_000, 200_000), (4, 16), 12)

    class Sage(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.self_lin = nn.Linear(cin, cout)
            self.nbr_lin = nn.Linear(cin, cout)

        def forward(self, x, src, dst, deg):
            agg = torch.zeros_like(x).index_add_(0, dst, x[src]) / deg[:, None]
            return self.self_lin(x) + self.nbr_lin(agg)

    dims = [feat] + [hidden] * (layers - 1) + [classes]
    convs = nn.ModuleList(Sage(a, b) for a, b in zip(dims, dims[1:])).to(device)
    opt = torch.optim.Adam(convs.parameters(), lr=1e-3)
    for _ in range(steps):
        mark()
        n = random.randint(*nodes)
        m = n * random.randint(*degree)
        src = torch.randint(0, n, (m,), device=device)
        dst = torch.randint(0, n, (m,), device=device)
        deg = torch.bincount(dst, minlength=n).clamp(min=1).float()
        x = torch.randn(n, feat, device=device)
        y = torch.randint(0, classes, (n,), device=device)
        h = x
        for i, conv in enumerate(convs):
            h = conv(h, src, dst, deg)
            if i < len(convs) - 1:
                h = torch.relu(h)
        loss = nn.functional.cross_entropy(h, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()


# ------------------------------------------------------------------------------------------
# a CuPy array pipeline (allocating from a mempool Pool; numpy on a CPU check)


def cupy_pipeline(xp, tiny, mark):
    """`xp` is cupy (recorded) or numpy (the CPU check); `mark` as for the others."""
    rng = random.Random(SEED)
    batches, sizes = (2, (16, 48)) if tiny else (12, (512, 2048))
    gen = xp.random.RandomState(SEED)

    def normal(shape):
        try:
            return gen.standard_normal(shape, dtype=xp.float32)    # CuPy: float32 drawn
        except TypeError:
            return gen.standard_normal(shape).astype(xp.float32)   # numpy draws float64
    for _ in range(batches):
        mark()
        count = rng.randint(4, 12)
        side = rng.randint(*sizes)
        imgs = normal((count, side, side))
        # Frequency-domain low-pass filter.
        spec = xp.fft.rfft2(imgs)
        fy = xp.fft.fftfreq(side)[:, None]
        fx = xp.fft.rfftfreq(side)[None, :]
        spec *= xp.exp(-(fy ** 2 + fx ** 2) * 50.0).astype(xp.float32)
        smooth = xp.fft.irfft2(spec, s=(side, side)).astype(xp.float32)
        del spec
        # Per-image normalisation, thresholding and statistics.
        mean = smooth.mean(axis=(1, 2), keepdims=True)
        std = smooth.std(axis=(1, 2), keepdims=True) + 1e-6
        norm = (smooth - mean) / std
        mask = norm > 1.0
        hist = xp.stack([xp.histogram(norm[i], bins=64, range=(-4, 4))[0]
                         for i in range(count)])
        top = xp.sort(norm.reshape(count, -1), axis=1)[:, -100:]
        coords = xp.nonzero(mask[0])
        # A matrix product over the flattened images (a feature projection).
        feats = norm.reshape(count, -1) @ normal((side * side, 64))
        summary = xp.concatenate([hist.astype(xp.float32), top, feats], axis=1)
        float(summary.sum()) + int(coords[0].size)
        del imgs, smooth, mean, std, norm, mask, hist, top, coords, feats, summary


WORKLOADS = {w.name: w for w in (
    Workload("bert_finetune", "tuning",
             "Hugging Face BertForSequenceClassification (bert-base config, random weights) "
             "fine-tuned with AdamW under bf16 autocast, gradient checkpointing, batches of 32 "
             "dynamically padded to their longest sequence (32..512 tokens)",
             bert_finetune, ("torch", "transformers"), 150),
    Workload("resnet50_train", "tuning",
             "torchvision ResNet-50 (random weights) trained with SGD and momentum under bf16 "
             "autocast, channels_last, batch 64 at 224 px, cudnn.benchmark on",
             resnet50_train, ("torch", "torchvision"), 150),
    Workload("gpt2_serving", "tuning",
             "Hugging Face GPT2LMHeadModel (gpt2 config with 6 layers, random weights, fp16) "
             "serving requests: greedy decoding with a growing KV cache, batch 1..32 and "
             "prompt 16..512 tokens per request, 8..24 new tokens each",
             gpt2_serving, ("torch", "transformers"), 150),
    Workload("rl_ppo", "tuning",
             "a PPO loop on small tensors: 64 vectorised environments simulated on the GPU, "
             "64-step rollouts, GAE, 2 epochs of 4 minibatches through a 256-wide MLP",
             rl_ppo, ("torch",), 150),
    Workload("moe_train", "held-out",
             "4 transformer blocks with 8-expert top-2 mixture-of-experts layers (hidden "
             "1024), uneven expert loads that change per step, AdamW under bf16 autocast, "
             "batch 8 x 512 tokens",
             moe_train, ("torch",), 150),
    Workload("unet_diffusion", "held-out",
             "a diffusion UNet in plain torch (channels 128..512, attention at the lowest "
             "resolution) trained on the DDPM noise objective, batch 16 of 4x64x64 latents, "
             "AdamW under bf16 autocast",
             unet_diffusion, ("torch",), 150),
    Workload("fasterrcnn_train", "held-out",
             "torchvision fasterrcnn_resnet50_fpn (no weights) trained with SGD on batches of "
             "4 random images of 320..1024 px a side, each with 1..12 random boxes",
             fasterrcnn_train, ("torch", "torchvision"), 180),
    Workload("gnn_train", "held-out",
             "a 3-layer GraphSAGE-style network in plain torch (index_add message passing) "
             "trained on a random graph per step of 20,000..200,000 nodes and 4..16 edges a "
             "node",
             gnn_train, ("torch",), 150),
    Workload("cupy_pipeline", "held-out",
             "a CuPy array pipeline allocating from a mempool Pool (cuda backend, default "
             "settings): per batch 4..12 random images of 512..2048 px, FFT low-pass, "
             "normalisation, histograms, sorts, a projection",
             cupy_pipeline, ("cupy",), 150),
)}
