"""Ranks of one pipeline in different collective calls (one in gather_timeline(), the other in step() or
clip_grad_norm_()): every rank ends with one PipelineError naming both calls, instead of gloo aborting the process
on two all-gathers of different sizes."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError, launch


def body(rank, other):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), schedule="1f1b",
                    num_microbatches=2, loss_fn=F.mse_loss, timeout=30)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.step(x, target=y)
    try:
        if rank == 0:
            pipe.gather_timeline()
        elif other == "step":
            pipe.step(x, target=y)
        else:
            pipe.clip_grad_norm_(1.0)
    except PipelineError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("other, says", [
    ("step", "pipeline ranks [0] are in gather_timeline(); pipeline ranks [1] opened the next step (step() or "
             "forward()); every rank of a pipeline must make the same calls"),
    ("clip", "pipeline ranks [0] are in gather_timeline(); pipeline ranks [1] are in clip_grad_norm_'s collective; "
             "every rank of a pipeline must make the same calls"),
])
def test_gather_timeline_against_another_call_is_one_error_on_every_rank(other, says):
    results = launch(body, 2, other, timeout=120)
    assert all("the pipeline ranks made different collective calls: " + says in r for r in results), results
