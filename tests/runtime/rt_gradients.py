"""Per-rank bodies of tests/runtime/test_gradients.py: which boundaries get a gradient, and settings that
change between steps (requires_grad, train/eval), each against the unsplit model."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import reference_step


class Detach(nn.Module):
    """A frozen feature extractor's boundary: nothing upstream gets a gradient through it."""

    def forward(self, x):
        return x.detach()


class TwoHeads(nn.Module):
    """Returns ``(a, b)``, both needing a gradient; ``b`` comes from its own Linear."""

    def __init__(self, width=8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.a(x), self.b(x)


class First(nn.Module):
    """Takes ``(a, b)`` and uses only ``a``: ``b`` gets no gradient in the unsplit model."""

    def forward(self, pair):
        return pair[0]


def detach_model(layers: int, detach_at: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Linear(8, 8) for _ in range(layers)]
    blocks.insert(detach_at, Detach())
    return nn.Sequential(*blocks)


def tuple_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), TwoHeads(), First(), nn.Linear(8, 8))


def grad_state(model, pipe):
    """{name: None | bytes of .grad} for this rank's parameters."""
    mine = {id(p) for p in pipe.parameters()}
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters() if id(p) in mine}


def same(mine: dict, ref_model) -> tuple[list, bool]:
    """(names whose .grad is None here, all grads equal to the reference's, None where its is None)."""
    ref = dict(ref_model.named_parameters())
    nones = sorted(n for n, g in mine.items() if g is None)
    equal = all((g is None and ref[n].grad is None) or (g is not None and ref[n].grad is not None
                                                       and torch.equal(g, ref[n].grad)) for n, g in mine.items())
    return nones, equal


def no_gradient_boundary(rank, make, schedule, v, balance, steps=2, **options):
    """AdamW with weight decay for ``steps`` steps: per step the .grad None pattern and values equal the unsplit
    model's, and at the end the weights are bitwise the same (decay must not move weights without a gradient)."""
    model = make()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v,
                    balance=balance, **options)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5)
    out = []
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4)
        nones, equal = same(grad_state(model, pipe), ref)
        out.append((nones, equal, bool(torch.equal(loss, ref_loss))))
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    mine = {id(p) for p in pipe.parameters()}
    weights = all(torch.equal(p, ref_params[n]) for n, p in model.named_parameters() if id(p) in mine)
    pipe.close()
    return {"steps": out, "weights_equal": weights}


def freeze_then_unfreeze(rank, schedule, v, **options):
    """Stage 0 frozen for step 1, unfrozen for step 2, frozen again for step 3 (a warm-up), then the whole
    model in eval() mode for step 4: each step equals the unsplit model with the same settings."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)) for _ in range(4)])
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v, **options)
    g = torch.Generator().manual_seed(5)
    first = 2 if v == 1 else 1  # the layers of stage 0: 2 stages of 2 layers, or 4 stages of 1
    out = []
    for frozen, train in ((True, True), (False, True), (True, True), (False, False)):
        for net in (model, ref):
            for p in net[:first].parameters():
                p.requires_grad_(not frozen)
            net.train(train)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4)
        nones, equal = same(grad_state(model, pipe), ref)
        out.append((nones, equal, bool(torch.equal(loss, ref_loss))))
        for net in (model, ref):
            net.zero_grad(set_to_none=True)
    pipe.close()
    return out


class ExtraInTraining(nn.Module):
    """Returns ``(x, 2x)`` in training mode and ``(x,)`` in eval mode: the message to the next stage changes."""

    def forward(self, x):
        return (x, 2 * x) if self.training else (x,)


class Join(nn.Module):
    def forward(self, parts):
        return sum(parts)


def eval_between_steps(rank):
    """step() in train mode, then in eval mode, then in train mode again: each equals the unsplit model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ExtraInTraining(), Join(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out = []
    for train in (True, False, True):
        model.train(train), ref.train(train)
        loss = pipe.step(x, target=y)
        out.append((bool(torch.equal(loss, reference_step(ref, x, y, 2))), same(grad_state(model, pipe), ref)[1]))
        model.zero_grad(), ref.zero_grad()
    pipe.close()
    return out


class Sometimes(nn.Module):
    """Detaches its input on odd calls: which input gets a gradient depends on the data, which is refused."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.detach() if self.calls > 4 else x


def data_dependent_gradient(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Sometimes(), nn.Linear(8, 8))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, balance=[1, 2])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, target=y)  # learns: stage 1's input gets a gradient on every microbatch
    try:
        pipe.step(x, target=y)
    except PipelineError as exc:
        return str(exc)
    return "no error"


def mixed_calls(rank):
    """Rank 0 calls forward() while rank 1 calls step(): the same ValueError on both, the pipeline usable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    try:
        pipe.forward(x) if rank == 0 else pipe.step(x, target=y)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    loss = pipe.step(x, target=y)
    return message, float(loss)


def step_under_no_grad(rank):
    """step() inside torch.no_grad() on every rank: the same ValueError everywhere, the pipeline still usable."""
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), schedule="1f1b", num_microbatches=2,
                    loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    try:
        with torch.no_grad():
            pipe.step(x, target=y)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    loss = pipe.step(x, target=y)
    pipe.close()
    return message, float(loss) > 0


def suite(rank):
    results = {}
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)):
        for options in ({}, {"split_backward": True}, {"recompute": True}):
            key = (schedule, tuple(options))
            results[("detach",) + key] = no_gradient_boundary(  # Linear, Linear | Detach, Linear, Linear
                rank, lambda: detach_model(4, 2), schedule, v, [2, 3] if v == 1 else [1, 1, 1, 2], **options)
            results[("tuple",) + key] = no_gradient_boundary(  # Linear, TwoHeads | First, Linear
                rank, tuple_model, schedule, v, [2, 2] if v == 1 else [1, 1, 1, 1], **options)
            results[("freeze",) + key] = freeze_then_unfreeze(rank, schedule, v, **options)
    results["eval"] = eval_between_steps(rank)
    results["data_dependent"] = data_dependent_gradient(rank)
    results["mixed_calls"] = mixed_calls(rank)
    results["no_grad"] = step_under_no_grad(rank)
    return results
