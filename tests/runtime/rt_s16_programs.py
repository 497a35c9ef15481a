"""Rank bodies of test_s16_programs.py: user programs the checker accepts, run on gloo against the unsplit model run
one microbatch at a time (loss, gradients, BatchNorm's running statistics)."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

import pipesched as ps
from pipesched.runtime import Pipeline


def model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()) for _ in range(stages)])


def reference(net, x, y, m):
    """The unsplit model's step, microbatch by microbatch: (loss, {name: grad}, {name: buffer})."""
    total = 0.0
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        loss = F.mse_loss(net(xm), ym) * (xm.shape[0] / x.shape[0])
        loss.backward()
        total = total + loss.detach()
    return total, {k: p.grad for k, p in net.named_parameters()}, {k: b.clone() for k, b in net.named_buffers()}


def run_program(rank, text, steps=2):
    """``steps`` steps of the program ``text`` (pipesched.loads): per step whether the loss equals the reference's,
    how many of this rank's parameters and buffers were compared, whether all are equal bitwise, and the largest
    relative gradient difference (to the reference gradient's largest element)."""
    program = ps.loads(text)
    torch.set_num_threads(1)
    net = model(program.num_stages)
    ref = copy.deepcopy(net)
    pipe = Pipeline(net, schedule=program, loss_fn=F.mse_loss)
    mine = {id(t) for t in [*pipe.parameters(), *(b for s in pipe.stages.values() for b in s.buffers())]}
    g = torch.Generator().manual_seed(3)
    report = []
    for _ in range(steps):
        x, y = torch.randn(4 * program.num_microbatches, 6, generator=g), torch.randn(4 * program.num_microbatches,
                                                                                      6, generator=g)
        loss = pipe.step(x, target=y)
        want, grads, buffers = reference(ref, x, y, program.num_microbatches)
        same = [torch.equal(p.grad, grads[k]) for k, p in net.named_parameters() if id(p) in mine]
        same += [torch.equal(b, buffers[k]) for k, b in net.named_buffers() if id(b) in mine]
        rel = max(float((p.grad - grads[k]).abs().max() / grads[k].abs().max())
                  for k, p in net.named_parameters() if id(p) in mine)
        report.append((torch.equal(loss, want), len(same), all(same), rel))
        for params in (net.parameters(), ref.parameters()):
            for p in params:
                p.grad = None
    pipe.close()
    return report
