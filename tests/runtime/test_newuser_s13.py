"""A stage output that is a column slice of a wider tensor (``h[:, 2:6]`` of an ``(n, 8)``: row-major with gaps
between rows, strides ``(8, 1)``, as ``h.chunk(2, -1)[0]`` gives). Found by a new user's trial (session 13): it was
sent dense, so the next stage's ``Linear`` ran on strides ``(4, 1)`` where the unsplit model ran on ``(8, 1)`` at
storage offset 2, and torch's CPU GEMM rounds those otherwise (up to 4.5e-8 on stage 0's bias; the loss equal).
Now it arrives with its strides and its offset's alignment (``runtime/layout.py``, ``Gapped``): bitwise. The test
first checks in-process that this machine's GEMM tells the layouts apart, and skips otherwise."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch


class Narrow(nn.Module):
    def __init__(self, dense=False):
        super().__init__()
        self.dense = dense

    def forward(self, t):
        t = t[:, 2:6]
        return t.contiguous() if self.dense else t


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Narrow(), nn.Linear(4, 4))
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    return model, x, y


def _reference_grads(model, x, y, m=4):
    """README recipe: one backward per microbatch of loss_fn(out_i, y_i) * (n_i / N), one thread."""
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
        (F.mse_loss(model(xi), yi) * (yi.shape[0] / x.shape[0])).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _rank(rank):
    model, x, y = _model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, balance=[2, 1], timeout=60.0)
    loss = pipe.step(x, target=y)
    ref_grads = _reference_grads(ref, x, y)
    grads = {k: (p.grad.clone(), ref_grads[k]) for k, p in model.named_parameters() if p.grad is not None}
    pipe.close()
    return {"loss": loss.item(), "grads": grads}


def test_column_slice_stage_output_gives_the_unsplit_models_gradients_bitwise():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, y = _model()
        strided = _reference_grads(copy.deepcopy(model), x, y)
        model[1].dense = True
        dense = _reference_grads(model, x, y)
    finally:
        torch.set_num_threads(threads)
    if all(torch.equal(strided[k], dense[k]) for k in strided):
        pytest.skip("this machine's GEMM rounds both layouts alike: nothing to observe")
    ranks = launch(_rank, 2, timeout=120)
    checked = 0
    for rank in (0, 1):
        for name, (ours, ref) in ranks[rank]["grads"].items():
            checked += 1
            assert torch.equal(ours, ref), (rank, name, (ours - ref).abs().max().item())
    assert checked == 4
