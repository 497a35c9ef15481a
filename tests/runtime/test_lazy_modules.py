"""A lazy module (``nn.LazyLinear``) not yet run has parameters without shapes: Pipeline refused it with torch's raw
"Attempted to use an uninitialized parameter" (a hunt's find, session 14); now a ValueError on every rank, before
any message, naming the parameter and what to do. Once run on a sample batch it trains as any model."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, launch
from pipesched.runtime.construction import refuse_lazy

LAZY = ("parameter '0.weight' is uninitialized (a lazy module such as LazyLinear before its first forward): run the "
        "model once on a sample batch (model(x)) before building the Pipeline, so that it takes its shapes")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 4))


def test_refuse_lazy_names_the_first_uninitialized_tensor_until_the_model_ran():
    model = _model()
    with pytest.raises(ValueError) as info:
        refuse_lazy(list(model), ["0", "1", "2"])
    assert str(info.value) == LAZY
    model(torch.randn(2, 3))
    assert refuse_lazy(list(model), ["0", "1", "2"]) is None


def _rank(rank, warm):
    model = _model()
    if warm:
        model(torch.randn(2, 3))
    try:
        pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=30)
    except ValueError as exc:
        return str(exc)
    x, y = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 4)
    loss = pipe.step(x, target=y)
    pipe.close()
    return loss.item()


def test_a_pipeline_of_a_lazy_model_is_refused_on_every_rank_then_trains_once_the_model_ran():
    assert launch(_rank, 2, False, timeout=120) == [LAZY, LAZY]
    losses = launch(_rank, 2, True, timeout=120)
    assert losses[0] == losses[1] and losses[0] > 0
