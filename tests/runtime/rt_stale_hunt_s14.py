"""Per-rank bodies of tests/runtime/test_stale_hunt_s14.py: a parameter that the user replaces between steps (a new
``nn.Parameter`` assigned to a layer's attribute, ``model.load_state_dict(..., assign=True)``, a tie re-made), a layer
replaced in the model, and ``pipe.loss_fn`` reassigned; after a restore, against the unsplit model run one
microbatch at a time, loss_i * (n_i / N) (README "Correctness")."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

W = 4


class Embed(nn.Module):
    """x @ w.t(), its weight tied to the head's below."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(W, W) * 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.w.t())


class Head(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return x @ self.w


def _replace(model, how):
    if how == "attr":  # a fresh Parameter with the same values, e.g. a re-initialisation or a weight re-tied by hand
        model[1].weight = nn.Parameter(model[1].weight.detach().clone())
    elif how == "assign":  # torch's load_state_dict(assign=True): every parameter becomes a new Parameter object
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    elif how == "retie":  # the tie re-made with a new Parameter shared by both layers
        new = nn.Parameter(model[0].w.detach().clone())
        model[0].w = new
        model[1].w = new


def _restore(model, old):
    """What the refusal says to do: the Parameters of construction back, holding the new values (copied in place)."""
    for prefix, module in model.named_modules():
        for key, new in list(module._parameters.items()):
            kept = old[f"{prefix}.{key}" if prefix else key]
            if new is not kept:
                with torch.no_grad():
                    kept.copy_(new)
                module._parameters[key] = kept


def _step_refused(pipe, model, x, y, old):
    """step() after a replacement: the refusal's text (every rank raises a ValueError), then the same step after
    :func:`_restore` (the pipeline stays usable)."""
    try:
        pipe.step(x, target=y)
        return None
    except ValueError as exc:
        text = str(exc)
    _restore(model, old)
    pipe.step(x, target=y)
    return text


def _reference(ref, xs, ys, total):
    for x, y in zip(xs, ys):
        (F.mse_loss(ref(x), y) * (y.shape[0] / total)).backward()


def replaced_dp(rank, how):
    """DP 2 x PP 2, 1f1b, m=2: step 1, then the parameter(s) replaced on the pipeline's model and on the unsplit one,
    step 2. Returns {name: (this rank's .grad, the unsplit model's .grad)} for the step-2 gradients of this rank's
    parameters (the unsplit reference: both replicas' microbatches, each weighted n_i / N_all)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, dp_size=2, timeout=60)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(8, W, generator=g), torch.randn(8, W, generator=g)
    replica = rank // 2
    x, y = X[replica * 4:(replica + 1) * 4], Y[replica * 4:(replica + 1) * 4]
    pipe.step(x, target=y)
    old = dict(model.named_parameters(remove_duplicate=False))
    for mdl in (model, ref):
        for p in mdl.parameters():
            p.grad = None
        _replace(mdl, how)
    text = _step_refused(pipe, model, x, y, old)
    _reference(ref, torch.tensor_split(X, 4), torch.tensor_split(Y, 4), 8)
    names = {id(p): n for n, p in model.named_parameters()}
    refs = dict(ref.named_parameters())
    out = {names[id(p)]: (p.grad.clone(), refs[names[id(p)]].grad.clone()) for p in pipe.parameters()}
    pipe.close()
    return text, out


def retied(rank):
    """2 ranks, 1f1b, m=2: an embedding (stage 0) tied to the head (stage 1); after step 1 the tie is re-made with a
    new Parameter on both layers (pipeline's model and unsplit one); step 2. Returns (this rank's copy's .grad, the
    unsplit model's .grad of the tied weight)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    emb = Embed()
    model = nn.Sequential(emb, Head(emb.w))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, W, generator=g), torch.randn(4, W, generator=g)
    pipe.step(x, target=y)
    old = dict(model.named_parameters(remove_duplicate=False))
    for mdl in (model, ref):
        for p in mdl.parameters():
            p.grad = None
        _replace(mdl, "retie")
    text = _step_refused(pipe, model, x, y, old)
    _reference(ref, torch.tensor_split(x, 2), torch.tensor_split(y, 2), 4)
    mine = model[rank].w  # rank 0 holds the embedding's copy, rank 1 the head's
    out = (text, mine.grad.clone(), ref[0].w.grad.clone())
    pipe.close()
    return out


def layer_replaced(rank):
    """2 ranks, 1f1b, m=2: ``model[1]`` replaced by a new Linear after step 1 (the stages hold the old one, which
    would run silently). Returns (step 2's refusal text, whether model[1] is back to the old layer's values after
    step 2 with the old layer put back, the loss of that step equal to the unsplit model's)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, W, generator=g), torch.randn(4, W, generator=g)
    pipe.step(x, target=y)
    kept = model[1]
    model[1] = nn.Linear(W, W)
    try:
        pipe.step(x, target=y)
        text = None
    except ValueError as exc:
        text = str(exc)
    with torch.no_grad():  # what the refusal says: the layer of construction back, holding the new values
        kept.load_state_dict(model[1].state_dict())
    model[1] = kept
    loss = pipe.step(x, target=y)
    want = sum(F.mse_loss(model(xm), ym) * (ym.shape[0] / 4)
               for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)))
    pipe.close()
    return text, torch.equal(loss, want.detach())


def loss_fn_reassigned(rank):
    """2 ranks, 1f1b, m=2: step 1 with ``loss_fn=F.mse_loss``, then ``pipe.loss_fn = F.l1_loss`` (the Pipeline's public
    attribute, which step() reads for its own check), step 2. Returns (step 2's loss, the unsplit model's l1 loss,
    {name: (this rank's .grad, the unsplit model's .grad)})."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), nn.Linear(W, W))
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, W, generator=g), torch.randn(4, W, generator=g)
    pipe.step(x, target=y)
    for p in model.parameters():
        p.grad = None
    pipe.loss_fn = F.l1_loss
    loss = pipe.step(x, target=y)
    want = None
    for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)):
        part = F.l1_loss(ref(xm), ym) * (ym.shape[0] / 4)
        part.backward()
        want = part.detach() if want is None else want + part.detach()
    refs = dict(ref.named_parameters())
    grads = {n: (p.grad.clone(), refs[n].grad.clone()) for n, p in model.named_parameters() if p.grad is not None}
    pipe.close()
    return loss, want, grads
