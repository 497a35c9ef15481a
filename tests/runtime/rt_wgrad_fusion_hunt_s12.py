"""Per-rank bodies of tests/runtime/test_wgrad_fusion_hunt_s12.py: each configuration three ways on the same data,
the unsplit model (one microbatch at a time, as ``rt_cases.reference_step``), a Pipeline with
``gradient_accumulation_fusion`` off and one with it on; per step the gradients, at the end the parameters after
SGD with momentum (Adam would turn the rounding noise of a gradient that is exactly zero in theory, a key bias's,
into whole steps)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from pipesched.runtime import GradScaler, Pipeline

from rt_cases import reference_step
from rt_wgrad_fusion import counted


class Block(nn.Module):
    """Pre-norm transformer block on (B, T, 8): attention by ``nn.MultiheadAttention`` (``kind="mha"``) or by
    hand (one qkv Linear, ``a @ o.weight.t() + o.bias``), then a GELU MLP; ``ckpt``: the block under
    ``torch.utils.checkpoint(use_reentrant=False)``."""

    def __init__(self, kind="mha", ckpt=False, d=8):
        super().__init__()
        self.ln1, self.ln2, self.kind, self.ckpt = nn.LayerNorm(d), nn.LayerNorm(d), kind, ckpt
        if kind == "mha":
            self.att = nn.MultiheadAttention(d, 2, batch_first=True)
        else:
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def attn(self, h):
        if self.kind == "mha":
            return self.att(h, h, h, need_weights=False)[0]
        q, k, v = self.qkv(h).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** .5, -1) @ v
        return a @ self.o.weight.t() + self.o.bias

    def body(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))

    def forward(self, x):
        return cp.checkpoint(self.body, x, use_reentrant=False) if self.ckpt else self.body(x)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(16, 8)

    def forward(self, ids):
        return self.e(ids)


def model(name):
    torch.manual_seed(0)
    if name in ("mha", "hand"):
        return nn.Sequential(*[Block(name, ckpt=name == "hand") for _ in range(4)])
    if name == "tied":  # zbv: the embedding (stage 0) and the head (stage 3) on rank 0, one Parameter
        emb, head = Embed(), nn.Linear(8, 16, bias=False)
        head.weight = emb.e.weight
        return nn.Sequential(emb, nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                             nn.Sequential(nn.Linear(8, 8), nn.Tanh()), head)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)])


def ce16(out, y):
    return F.cross_entropy(out.reshape(-1, 16), y.reshape(-1))


def data(name, step, n):
    g = torch.Generator().manual_seed(100 + step)
    if name == "tied":
        return torch.randint(0, 16, (n, 5), generator=g), torch.randint(0, 16, (n, 5), generator=g)
    shape = (n, 5, 8) if name in ("mha", "hand") else (n, 8)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _grads(model_, names):
    return {k: None if p.grad is None else p.grad.clone() for k, p in model_.named_parameters() if k in names}


def _worst(a, b):
    """The largest |a - b| relative to max |a|, over the parameters; inf where one .grad is None and the other
    not."""
    worst = 0.0
    for k in a:
        if (a[k] is None) != (b[k] is None):
            return float("inf")
        if a[k] is not None:
            worst = max(worst, float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)))
    return worst


def three_way(name, schedule, v=1, m=4, n=8, steps=2, zero="none", scaler=False, clip=None, accumulate=False,
              hooks=None):
    """``zero``: "none" or "zeros" (``zero_grad(set_to_none=False)``: the first microbatch fuses too);
    ``accumulate``: step() twice per optimizer step; ``hooks``: "post" (``register_post_accumulate_grad_hook`` on
    every weight: declined) or "node" (on every Linear weight's accumulate node); counted per model."""
    loss_fn = ce16 if name == "tied" else F.mse_loss
    base = model(name)
    ref, mods, pipes, opts, scalers = copy.deepcopy(base), [], [], [], []
    for fuse in (False, True):
        mods.append(copy.deepcopy(base))
        pipes.append(Pipeline(mods[-1], schedule=schedule, num_microbatches=m, loss_fn=loss_fn, virtual_stages=v,
                              gradient_accumulation_fusion=fuse))
        opts.append(torch.optim.SGD(pipes[-1].parameters(), lr=0.1, momentum=0.9))
        scalers.append(GradScaler(pipes[-1], init_scale=256.0, growth_interval=1) if scaler else None)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1) if scaler else None
    names = [{k for k, p in mod.named_parameters() if id(p) in {id(q) for q in pipe.parameters()}}
             for mod, pipe in zip(mods, pipes)]
    assert names[0] == names[1]
    names = names[0]
    ran = {"ref": 0, "off": 0, "on": 0}
    keep = []  # accumulate nodes with hooks live only while referenced
    for key, mod in zip(ran, (ref, *mods)):
        for pname, p in mod.named_parameters():
            if hooks == "post" and pname.endswith("weight") and pname in names:
                p.register_post_accumulate_grad_hook(lambda _, key=key: ran.__setitem__(key, ran[key] + 1))
            if hooks == "node" and pname.endswith("weight") and pname in names:
                keep.append(p.view_as(p).grad_fn.next_functions[0][0])
                keep[-1].register_hook(lambda *_, key=key: ran.__setitem__(key, ran[key] + 1))
    rows, fused = [], {"fused": 0, "declined": 0}
    for step in range(steps):
        x, y = data(name, step, n)
        with counted() as calls:
            losses = [pipe.step(x, target=y, scaler=sc) for pipe, sc in zip(pipes, scalers)]
        fused = {k: fused[k] + calls[k] for k in fused}
        scaled = (lambda o, t: ref_scaler.scale(loss_fn(o, t))) if scaler else loss_fn
        ref_loss = reference_step(ref, x, y, m, loss_fn=scaled) / (ref_scaler.get_scale() if scaler else 1.0)
        g_ref, g_off, g_on = (_grads(mod, names) for mod in (ref, *mods))
        rows.append({"off_bitwise": all(a is None and b is None or a is not None and b is not None and
                                        torch.equal(a, b) for a, b in zip(g_ref.values(), g_off.values())),
                     "off": _worst(g_ref, g_off), "on": _worst(g_ref, g_on),
                     "loss_equal": bool(torch.equal(losses[0], ref_loss) and torch.equal(losses[1], ref_loss))})
        if accumulate and step % 2 == 0:
            continue
        every = list(zip(opts, scalers, pipes)) + [(ref_opt, ref_scaler, None)]
        if scaler:
            for o, sc, _ in every:
                sc.unscale_(o)
        if clip:
            rows[-1]["norms"] = [float(p.clip_grad_norm_(clip) if p is not None else
                                       torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)) for _, _, p in every]
        for o, sc, _ in every:
            if scaler:
                sc.step(o)
                sc.update()
            else:
                o.step()
            o.zero_grad(set_to_none=zero == "none")
    with torch.no_grad():
        final = [_worst({k: p.detach() for k, p in ref.named_parameters() if k in names},
                        {k: p.detach() for k, p in mod.named_parameters() if k in names}) for mod in mods]
    for pipe in pipes:
        pipe.close()
    return {"rows": rows, "params_off": final[0], "params_on": final[1], "calls": fused, "hooks": ran}


CONFIGS = {
    # 3-D (B, T, 8) through nn.MultiheadAttention's F.linear, LayerNorm, GELU: 60 x 5 = 300 rows per microbatch
    "mha-dualpipev-rows": dict(name="mha", schedule="dualpipev", v=2, m=4, n=240),
    # hand-written attention (x @ w.t()) under non-reentrant checkpoint, zb-h1
    "hand-ckpt-zbh1": dict(name="hand", schedule="zb-h1", m=4, n=8),
    # one Parameter as embedding (stage 0) and head (stage 3, fused) on rank 0
    "tied-zbv": dict(name="tied", schedule="zbv", v=2, m=4, n=8),
    # .grad zeros (fused from the first microbatch), uneven microbatches (10 rows / 4), two step() per optimizer
    # step, GradScaler, unscale_ then pipe.clip_grad_norm_
    "zeros-scaler-clip": dict(name="mlp", schedule="zbv", v=2, m=4, n=10, steps=4, zero="zeros", scaler=True,
                              clip=0.05, accumulate=True),
    "post-hooks": dict(name="mlp", schedule="zbv", v=2, m=4, n=8, hooks="post"),
    "node-hooks": dict(name="mlp", schedule="1f1b", m=4, n=8, hooks="node"),
}


def suite(rank):
    return {key: three_way(**spec) for key, spec in CONFIGS.items()}
