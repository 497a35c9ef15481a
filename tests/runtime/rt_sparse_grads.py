"""Per-rank bodies of tests/runtime/test_sparse_grads.py (4 spawned gloo ranks): sparse gradients
(nn.Embedding(sparse=True)) through the data-parallel ALL_REDUCE and the tied-gradient TIE_REDUCE (summed dense,
runtime/grad_sum.py), and clip_grad_norm_, against the unsplit model (averaged over the replicas' batches)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import reference_step

V, D, M = 16, 8, 2  # vocabulary, width, microbatches per replica
WORLD = 4


def model_of(kind: str, seed: int = 0) -> nn.Sequential:
    """``"plain"``: Embedding(16, 8, sparse=True), Linear, Tanh, Linear(8 -> 16); ``"tied"``: the same with the last
    Linear's weight the embedding's (no bias): a sparse use and a dense use of one parameter."""
    torch.manual_seed(seed)
    emb, head = nn.Embedding(V, D, sparse=True), nn.Linear(D, V, bias=kind != "tied")
    if kind == "tied":
        head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(D, D), nn.Tanh(), head)


def ce(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def batch(step: int, replica: int):
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randint(0, 12, (4, 3), generator=g), torch.randint(0, V, (4, 3), generator=g)  # rows 12-15 unused


def dense(t):
    return None if t is None else (t.to_dense() if t.is_sparse else t)


def reference_grads(ref, step: int, replicas: int) -> dict:
    """{name: the unsplit model's gradient averaged over the replicas' batches (dense)} (ref's .grad left summed)."""
    total = {}
    for r in range(replicas):
        ref.zero_grad(set_to_none=True)
        reference_step(ref, *batch(step, r), M, ce)
        for name, p in ref.named_parameters():
            total[name] = dense(p.grad) if name not in total else total[name] + dense(p.grad)
    return {name: g / replicas if replicas > 1 else g for name, g in total.items()}


def compare(pipe, model, expect: dict) -> dict:
    """This rank's gradients against ``expect``: names, layouts, bitwise, largest relative difference."""
    ids = {id(p) for p in pipe.parameters()}
    mine = {n: p for n, p in model.named_parameters() if id(p) in ids}
    worst, bitwise = 0.0, True
    for n, p in mine.items():
        got, want = dense(p.grad), expect[n]
        bitwise &= torch.equal(got, want)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return {"names": sorted(mine), "sparse": sorted(n for n, p in mine.items() if p.grad.is_sparse),
            "bitwise": bool(bitwise), "worst": worst}


def sparse_case(rank, kind: str, dp_size: int, steps: int = 2, clip: float | None = None):
    """``steps`` SGD steps (SGD takes sparse gradients) on pipe and the unsplit model; per step the gradient
    comparison; with ``clip``, pipe.clip_grad_norm_(clip) against torch's clip_grad_norm_ of the reference's
    gradients made dense (torch's own has no sparse norm), then the comparison again."""
    model = model_of(kind)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=ce, dp_size=dp_size)
    replica = pipe.grid.dp_rank
    params = list(pipe.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None  # pp=4: pipeline rank 2 holds only Tanh
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        pipe.step(*batch(step, replica))
        expect = reference_grads(ref, step, dp_size)
        row = compare(pipe, model, expect)
        for name, p in ref.named_parameters():
            p.grad = expect[name].clone()
        if clip is not None:
            total = pipe.clip_grad_norm_(clip)
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            row["clip_rel"] = abs(float(total) - float(ref_total)) / float(ref_total)
            row["clipped"] = compare(pipe, model, {n: p.grad for n, p in ref.named_parameters()})
        if opt is not None:
            opt.step(), opt.zero_grad()
        ref_opt.step(), ref_opt.zero_grad()
        out.append(row)
    pipe.close()
    return out


def suite(rank):
    return {"dp": sparse_case(rank, "plain", 2), "tied-dp": sparse_case(rank, "tied", 2),
            "tied-pp4": sparse_case(rank, "tied", 1), "clip-dp": sparse_case(rank, "plain", 2, clip=0.05)}
