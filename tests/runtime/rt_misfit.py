"""Per-rank body of tests/runtime/test_misfit.py (2 ranks, 1f1b, m=2): one rank's collective call whose arguments
do not fit its signature -- Python's ``TypeError``, raised before the method's body -- is carried to the other rank
in the call's first collective row (runtime/misfit.py), so both raise and, the error caught, stay in step: the next
correct call on both ranks gives the unsplit model's values."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pipesched.runtime import GradScaler, Pipeline, load_checkpoint, save_checkpoint

from rt_cases import mlp, outcome, reference_step

M = 2
TIMEOUT = 60.0  # a rank left waiting would raise a timeout error, which the test refuses; nothing here is timed


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


class TaggedPipeline(Pipeline):
    """A user's subclass with a step() of its own: Python binds its arguments before Pipeline.step's guard runs."""

    def step(self, x=None, target=None, tag=None):
        return super().step(x, target)

    def forward(self, x=None, tag=None):
        out = super().forward(x)
        return None if out is None else (tag, out)


def misfits(rank, folder):
    """Rank 1 alone misspells a keyword of each collective call; rank 0 calls it right. Returns
    ``{call: (outcome, what the next correct call gave)}`` and the unsplit model's values to compare."""
    bad = rank == 1
    out = {}
    kwargs = dict(num_microbatches=M, loss_fn=F.mse_loss, timeout=TIMEOUT)
    out["Pipeline"] = outcome(lambda: Pipeline(mlp(num_layers=4), schedul="1f1b", **kwargs) if bad else
                               Pipeline(mlp(num_layers=4), schedule="1f1b", **kwargs))
    model = mlp(num_layers=4)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", **kwargs)  # the job goes on: the next construction on both ranks
    x, y = _batch(1)
    out["step"] = float(pipe.step(x, y))
    sub_model = mlp(num_layers=4, seed=3)
    sub_ref = copy.deepcopy(sub_model)
    sub = TaggedPipeline(sub_model, schedule="1f1b", **kwargs)
    out["subclass step"] = outcome(lambda: sub.step(x, y, "tag", "extra") if bad else sub.step(x, y, "tag"))
    out["subclass next step"] = float(sub.step(x, y, "tag"))
    out["subclass reference"] = float(reference_step(sub_ref, x, y, M))
    called = sub(x, "tag")  # pipe(x) is the subclass's own forward
    merged = torch.cat([sub_ref(c) for c in x.chunk(M)])  # the unsplit model, one microbatch at a time
    out["subclass call"] = called if called is None else (called[0], torch.equal(called[1], merged))
    out["subclass call misfit"] = outcome(lambda: sub(x, "tag", "extra") if bad else sub(x, "tag"))
    sub.close()
    out["reference step"] = float(reference_step(ref, x, y, M))
    out["clip_grad_norm_"] = outcome(lambda: pipe.clip_grad_norm_(1e-3, norm=2.0) if bad else
                                      pipe.clip_grad_norm_(1e-3))
    total = pipe.clip_grad_norm_(1e-3)  # the next correct call: the unsplit model's norm, on both ranks
    out["total"], out["reference total"] = float(total), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3))
    out["gather_timeline"] = outcome(lambda: pipe.gather_timeline(kinds="step") if bad else pipe.gather_timeline())
    out["timeline ranks"] = sorted({e.rank for e in pipe.gather_timeline().events})
    work = lambda pp_group, dp_group: torch.distributed.get_world_size(pp_group)  # noqa: E731
    out["collective"] = pipe.run_collective(work)
    doomed = Pipeline(mlp(num_layers=4), schedule="1f1b", **kwargs)  # a misfit run_collective fails its Pipeline
    reduce = lambda pp_group, dp_group: torch.distributed.all_reduce(torch.ones(1), group=pp_group)  # noqa: E731
    out["run_collective"] = outcome(lambda: doomed.run_collective(reduce, meat=False) if bad else
                                     doomed.run_collective(reduce, meet=False))  # rank 0 waits in the all-reduce
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    path = f"{folder}/ckpt"
    out["save_checkpoint"] = outcome(lambda: save_checkpoint(path, pipe, optimiser=opt) if bad else
                                      save_checkpoint(path, pipe, optimizer=opt))
    out["saved"] = save_checkpoint(path, pipe, optimizer=opt, step=1).endswith("ckpt")
    out["load_checkpoint"] = outcome(lambda: load_checkpoint(path, pipe, opt, 5) if bad else
                                      load_checkpoint(path, pipe, opt))
    out["loaded step"] = load_checkpoint(path, pipe, opt).step
    scaler = GradScaler(pipe)  # last: a GradScaler's failed collective call ends the pipeline on every rank
    pipe.step(x, y, scaler=scaler)
    out["GradScaler.unscale_"] = outcome(lambda: scaler.unscale_(opt, 5) if bad else scaler.unscale_(opt))
    return out
