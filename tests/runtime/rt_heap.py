"""Per-rank body of tests/runtime/test_heap.py: a split-backward pipeline's page faults, resident memory and
gradients, step after step, against the unsplit model."""
from __future__ import annotations

import copy
import resource

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline

from rt_cases import reference_step

WIDTH, LAYERS, BATCH, M, STEPS = 512, 4, 256, 8, 12


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def same_grad(a, b) -> bool:
    """Both None (no gradient reached), or bitwise equal."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def run(schedule: str, split: bool) -> dict:
    """STEPS steps, .grad set to None between them: per step the minor page faults of the step, the resident
    bytes after it, and whether loss and gradients are bitwise the unsplit model's."""
    net = model()
    ref = copy.deepcopy(net)
    pipe = Pipeline(net, schedule=schedule, num_microbatches=M, loss_fn=F.mse_loss, split_backward=split)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    mine = {id(p) for p in pipe.parameters()}
    pairs = [(p, q) for p, q in zip(net.parameters(), ref.parameters()) if id(p) in mine]
    faults, resident, equal = [], [], []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = pipe.step(x, target=y)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        resident.append(resident_bytes())
        expect = reference_step(ref, x, y, M)
        same = all(same_grad(p.grad, q.grad) for p, q in pairs)
        equal.append(same and (loss is None or torch.equal(loss, expect)))
        for p, q in pairs:
            p.grad = q.grad = None
    return {"faults": faults, "resident": resident, "equal": equal, "params": len(pairs)}


def suite(rank: int) -> dict:
    torch.set_num_threads(1)
    return {(schedule, split): run(schedule, split) for schedule, split in (("zb-h1", True), ("1f1b", True),
                                                                           ("1f1b", False))}
