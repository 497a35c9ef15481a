"""Per-rank body of tests/runtime/test_lead.py: the step's lead (runtime/lead.py), stage 0's first forward run
while the step's opening all-gather is in flight, on 2 ranks (1f1b, m=2, 6 layers cut 3 / 3)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError
from pipesched.runtime.executor import Executor

M = 2


def count_leads() -> dict:
    """Wrap ``Executor.lead`` in this process; returns {kind (True: step, False: forward): leads that ran}."""
    counts = {True: 0, False: 0}
    plain = Executor.lead

    def lead(self, train, microbatches, is_tuple):
        done = plain(self, train, microbatches, is_tuple)
        counts[train] += done is not None
        return done

    Executor.lead = lead
    return counts


class FailOnce(nn.Module):
    """Identity that raises ``RuntimeError("planted")`` on its ``at``-th call (counting from 1)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("planted")
        return x


class WritesInput(nn.Module):
    def forward(self, x):
        return x.mul_(1.0)  # an in-place write to the stage input (x needs no grad)


def model(first=None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), first if first is not None else nn.Dropout(0.5), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)


def refusal(rank):
    """Steps 1, 2 (refused: the target has 3 rows, x 4), 3 on one pipeline; steps 1, 3 on another built alike.
    Returns both runs' last loss and gradients (as lists), the RNG state digests after them, and the leads."""
    counts = count_leads()
    runs = {}
    for name, refused in (("with", True), ("without", False)):
        torch.manual_seed(1)
        pipe = Pipeline(model(), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss)
        before = dict(counts)
        pipe.step(*batch(1))
        error = None
        if refused:
            x, y = batch(2)
            try:
                pipe.step(x, target=y[:3])
            except ValueError as exc:
                error = str(exc)
        for p in pipe.parameters():
            p.grad = None
        loss = pipe.step(*batch(3))
        runs[name] = {"loss": loss.item(), "grads": [p.grad.tolist() for p in pipe.parameters()],
                      "rng": torch.get_rng_state().sum().item(), "error": error,
                      "leads": counts[True] - before[True]}
        pipe.close()
    return runs


def lead_error(rank):
    """Stage 0 raises in its 3rd forward: the lead of step 2 (F0.0); then the same with a refused step 2."""
    counts = count_leads()
    out = {}
    torch.manual_seed(1)
    pipe = Pipeline(model(FailOnce(3)), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss)
    pipe.step(*batch(1))  # calls 1 and 2
    try:
        pipe.step(*batch(2))
    except PipelineError as exc:
        out["failed"] = str(exc)
    out["leads"] = counts[True]
    torch.manual_seed(1)
    pipe = Pipeline(model(FailOnce(3)), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss)
    pipe.step(*batch(1))
    x, y = batch(2)
    try:
        pipe.step(x, target=y[:3])  # refused by the last stage's rank: its refusal, not the lead's error
    except ValueError as exc:
        out["refused"] = str(exc)
    out["after"] = pipe.step(*batch(3)).item()  # usable: the forward raised once only
    pipe.close()
    return out


def no_lead(rank):
    """Leads per kind of stage 0 where a lead could not be undone, over 3 steps and 2 forwards each."""
    out = {}
    cases = {"buffers": lambda: model(nn.BatchNorm1d(8)),
             "hook": lambda: _hooked(model()),
             "writes input": lambda: nn.Sequential(WritesInput(), *list(model())[:5], nn.Linear(8, 4)),
             "plain": model}
    counts = count_leads()
    for name, build in cases.items():
        before = dict(counts)
        pipe = Pipeline(build(), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss)
        for seed in range(3):
            pipe.step(*batch(seed))
        for seed in range(2):
            pipe.forward(batch(seed)[0])
        out[name] = (counts[True] - before[True], counts[False] - before[False])
        pipe.close()
    with torch.nn.modules.module.register_module_forward_hook(lambda *args: None):
        before = dict(counts)
        pipe = Pipeline(model(), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss)
        for seed in range(3):
            pipe.step(*batch(seed))
        out["global hook"] = (counts[True] - before[True], counts[False] - before[False])
        pipe.close()
    return out


def _hooked(net):
    net[0].register_forward_hook(lambda *args: None)
    return net


def forward_outputs(rank):
    """forward() twice (the second with a lead) against the unsplit model in eval mode."""
    counts = count_leads()
    net = model()
    net.eval()
    ref = copy.deepcopy(net)
    pipe = Pipeline(net, schedule="1f1b", num_microbatches=M)
    x = batch(5)[0]
    outs = [pipe.forward(x) for _ in range(2)]
    pipe.close()
    with torch.no_grad():
        want = ref(x)
    return {"leads": counts[False],
            "equal": [None if o is None else bool(torch.equal(o, want)) for o in outs]}
