"""Per-rank bodies of tests/runtime/test_inplace_first_layer.py (2 spawned gloo ranks): stages whose first layer
has ``inplace=True`` (nn.ReLU, nn.LeakyReLU, nn.Hardtanh, nested in an nn.Sequential block too) train as the
unsplit model does, bitwise, over several optimizer steps: received inputs, an input from a stage on the same
rank (zbv: stages 1 and 2 on pipeline rank 1), recompute, split backward."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline
from pipesched.runtime.stage import ClonedInputStage

from rt_cases import grad_report, params_equal, reference_step
from rt_workers import _data


def _blocks(seed: int = 0):
    torch.manual_seed(seed)
    lin = lambda: nn.Linear(8, 8)  # noqa: E731
    return {
        # balance=None on 2 ranks cuts [Linear, Linear] | [ReLU(inplace), Linear] (the new-user trial's model)
        "relu": [lin(), lin(), nn.ReLU(inplace=True), lin()],
        # 4 stages (zbv / 2 virtual), one layer each: every stage after the first starts in place (under zbv
        # stage 2 gets stage 1's output on the same rank)
        "each": [lin(), nn.Sequential(nn.LeakyReLU(0.1, inplace=True), lin()),
                 nn.Sequential(nn.Hardtanh(-0.5, 0.5, inplace=True), lin()), nn.Sequential(nn.ReLU(True), lin())],
    }


CASES = {  # name -> (model, Pipeline options)
    "relu-1f1b": ("relu", dict(schedule="1f1b")),
    "relu-gpipe-recompute": ("relu", dict(schedule="gpipe", recompute=True)),
    "relu-1f1b-split": ("relu", dict(schedule="1f1b", split_backward=True)),
    "each-zbv": ("each", dict(schedule="zbv")),
    "each-interleaved-recompute": ("each", dict(schedule="interleaved-1f1b", virtual_stages=2, recompute=True)),
}


def case(rank, name, steps=3, m=4):
    """AdamW steps; per step: loss equal, gradients bitwise; at the end weights bitwise; and which of this rank's
    stages got a copy of their input (ClonedInputStage)."""
    kind, options = CASES[name]
    model = nn.Sequential(*_blocks()[kind])
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, num_microbatches=m, loss_fn=F.mse_loss, **options)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    out = []
    for step in range(steps):
        x, y = _data(step)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, m)
        count, equal, _ = grad_report(pipe, model, ref)
        out.append((bool(torch.equal(loss, ref_loss)), count, equal))
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    result = {"steps": out, "params_equal": params_equal(pipe, model, ref),
              "cloned": sorted(s for s, module in pipe.stages.items() if isinstance(module, ClonedInputStage))}
    pipe.close()
    return result


def suite(rank):
    return {name: case(rank, name) for name in CASES}
