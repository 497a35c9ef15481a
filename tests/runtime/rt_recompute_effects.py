"""Per-rank body of tests/runtime/test_recompute_effects.py: recompute must leave no trace a plain run would
not (buffers, hooks). Every case compares with the unsplit model run in this process over the same
microbatches in order, and returns plain values that the parent asserts on."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError

from rt_cases import grad_report, reference_forward, reference_step

M = 4  # microbatches
N = 16  # rows per batch: 4 per microbatch (BatchNorm needs more than one)


class Counter(nn.Module):
    """Counts its calls in a buffer and scales its input by ``1 + 0.1 * count``: its output depends on a buffer
    its own forward changes, so a recompute must see the count its first forward saw."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return x * (1 + 0.1 * self.count)


def bn_model(seed=0) -> nn.Sequential:
    """The issue's example with a Counter after each BatchNorm: 9 layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), Counter(), nn.ReLU(),
                         nn.Linear(16, 16), nn.BatchNorm1d(16), Counter(), nn.ReLU(), nn.Linear(16, 4))


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 8, generator=g), torch.randn(N, 4, generator=g)


def _local_buffers(pipe, model, ref):
    """This rank's buffers: ``(all bitwise equal to the reference's, {name: value})`` for the scalar ones
    (``num_batches_tracked``, ``count``)."""
    mine = {id(b) for module in pipe.stages.values() for b in module.buffers()}
    ref_buffers = dict(ref.named_buffers())
    equal, scalars = True, {}
    for name, b in model.named_buffers():
        if id(b) not in mine:
            continue
        equal &= torch.equal(b, ref_buffers[name])
        if b.dim() == 0:
            scalars[name] = float(b)
    return equal, scalars


def train_case(rank, schedule, v, balance, recompute, split_backward=False, steps=2, make=bn_model):
    """``steps`` optimizer steps then an eval-mode forward; after each step: loss equal, gradients and this
    rank's buffers bitwise equal to the unsplit model's, and the scalar buffers' values; at the end, whether the
    stages still hold the buffer tensors they held before the first step."""
    model = make()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, virtual_stages=v,
                    balance=balance, recompute=recompute, split_backward=split_backward, timeout=60.0)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out = {"steps": []}
    objects = [b for module in pipe.stages.values() for b in module.buffers()]  # updated in place, as in plain runs
    for step in range(steps):
        x, y = _data(step)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, M)
        count, grads_equal, _ = grad_report(pipe, model, ref)
        buffers_equal, scalars = _local_buffers(pipe, model, ref)
        out["steps"].append({"loss": bool(torch.equal(loss, ref_loss)), "grads": grads_equal and count > 0,
                             "buffers": buffers_equal, "scalars": scalars})
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    model.eval(); ref.eval()
    x, _ = _data(99)
    got = pipe.forward(x)
    expect = reference_forward(ref, x, M)
    out["eval"] = None if got is None else bool(torch.equal(got, expect))
    out["eval_buffers"] = _local_buffers(pipe, model, ref)
    out["has_r"] = any(i.op.value == "R" for i in pipe.program.ranks[pipe.pp_rank])
    out["same_objects"] = all(a is b for a, b in zip(objects, [b for m in pipe.stages.values() for b in m.buffers()]))
    pipe.close()
    return out


def sn_model(seed=0) -> nn.Sequential:
    """A spectral-normalised Linear (the parametrization: its forward updates the ``_u``/``_v`` buffers in place
    and its weight depends on them) on each stage."""
    torch.manual_seed(seed)
    sn = nn.utils.parametrizations.spectral_norm
    return nn.Sequential(nn.Linear(8, 16), sn(nn.Linear(16, 16)), nn.Tanh(), sn(nn.Linear(16, 16)), nn.Linear(16, 4))


def _hook(module, args, output):
    return None


def _pre_hook(module, args):
    return None


def construct_with_hook(rank, where, recompute):
    """Build a Pipeline of ``bn_model`` (balance [4, 5]) with a hook: ``("forward", layer)``,
    ``("pre", layer)`` or ``("global", None)``. Returns the error's type and message, or the hook's call count
    after one step if construction succeeds."""
    model = bn_model()
    kind, layer = where
    calls = {"n": 0}

    def counting(module, args, output):
        calls["n"] += 1

    handle = None
    if kind == "forward":
        model[layer].register_forward_hook(_hook)
    elif kind == "pre":
        model[layer].register_forward_pre_hook(_pre_hook)
    elif kind == "counting":
        model[layer].register_forward_hook(counting)
    else:
        handle = nn.modules.module.register_module_forward_hook(_hook)
    try:
        pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, balance=[4, 5],
                        recompute=recompute, timeout=30.0)
    except ValueError as exc:
        return {"type": "ValueError", "message": str(exc)}
    finally:
        if handle is not None:
            handle.remove()
    pipe.step(*_data(0))
    pipe.close()
    return {"type": None, "calls": calls["n"]}


def hook_after_construction(rank):
    """A forward hook registered on layer 5 (BatchNorm1d, stage 1, recomputed) after construction: the step
    fails at stage 1's first R, on both ranks, with the message naming the layer."""
    model = bn_model()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, balance=[4, 5],
                    recompute=True, timeout=30.0)
    model[5].register_forward_hook(_hook)
    try:
        pipe.step(*_data(0))
    except PipelineError as exc:
        return {"type": "PipelineError", "rank": exc.rank, "op": exc.op, "stage": exc.stage, "cause": exc.cause}
    return {"type": None}


def suite(rank):
    results = {}
    for schedule, v, balance, one in (("gpipe", 1, [4, 5], [False, True]), ("1f1b", 1, [4, 5], [True, False]),
                                      ("interleaved-1f1b", 2, [3, 2, 2, 2], [False, False, True, False])):
        for recompute in (True, one, False):
            results[(schedule, str(recompute))] = train_case(rank, schedule, v, balance, recompute)
        results[(schedule, "split")] = train_case(rank, schedule, v, balance, True, split_backward=True)
    results["sn"] = train_case(rank, "1f1b", 1, [2, 3], True, make=sn_model)
    results["sn_plain"] = train_case(rank, "1f1b", 1, [2, 3], False, make=sn_model)
    results["hook"] = construct_with_hook(rank, ("forward", 1), True)
    results["pre_hook"] = construct_with_hook(rank, ("pre", 6), [False, True])
    results["global_hook"] = construct_with_hook(rank, ("global", None), True)
    results["hook_plain_stage"] = construct_with_hook(rank, ("counting", 6), [True, False])
    results["hook_later"] = hook_after_construction(rank)  # last: it breaks its pipeline
    return results
