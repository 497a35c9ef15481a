"""A list of tensors between stages (and as ``x`` and ``target``) arrives as a list, as in the unsplit model.

Until session 14 a list was taken apart like a tuple and rebuilt as a tuple: a layer that appends to its input,
or checks ``isinstance(x, list)``, behaved otherwise after the split than before it (the README said so). Now
the meta's first word says tensor, tuple or list, and the receiver (another rank, or a stage on the same rank,
or a recompute's replay) rebuilds the same kind. Each layer here raises if it gets another kind; gradients are
compared bitwise with the unsplit model's one-microbatch-at-a-time reference."""
import copy

import pytest
import torch
from torch import nn

from pipesched.runtime import Pipeline, PipelineError, launch
from pipesched.runtime.wire import decode_meta, describe_change, encode_meta, meta_of
from pipesched.runtime.microbatch import LIST, TENSOR, TUPLE, as_tuple, as_value


def _expect(value, kind, where):
    if type(value) is not kind:
        raise TypeError(f"{where} got a {type(value).__name__}, expected a {kind.__name__}")


class Pair(nn.Module):
    """A Linear on each element of a list; appends nothing, returns a new list (``kind`` in, ``kind`` out)."""

    def __init__(self, width, kind=list):
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(width, width), nn.Linear(width, width), kind

    def forward(self, xs):
        _expect(xs, list, "Pair")
        return self.kind([torch.tanh(self.a(xs[0])), torch.tanh(self.b(xs[1]))])


class Join(nn.Module):
    def forward(self, xs):
        _expect(xs, list, "Join")
        return xs[0] * xs[1]


def _loss(out, target):
    _expect(target, list, "loss_fn's target")
    return ((out - target[0]) ** 2).mean() + target[1].mean() * 0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Pair(6), Pair(6), Pair(6), Pair(6), Join())


def _batch():
    torch.manual_seed(1)
    return [torch.randn(8, 6), torch.randn(8, 6)], [torch.randn(8, 6), torch.randn(8, 6)]


def _reference(model, m=4):
    x, y = _batch()
    for i in range(m):
        xi, yi = [t.tensor_split(m)[i] for t in x], [t.tensor_split(m)[i] for t in y]
        (_loss(model(xi), yi) * (xi[0].shape[0] / x[0].shape[0])).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _rank(rank, schedule, recompute):
    model = _model()
    ref = _reference(copy.deepcopy(model))
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=_loss, recompute=recompute, timeout=60.0)
    x, y = _batch()
    pipe.step(x, target=y)
    grads = {k: torch.equal(p.grad, ref[k]) for k, p in model.named_parameters() if p.grad is not None}
    out = pipe.forward(x)  # no autograd: the other branch of F
    pipe.close()
    return grads, out, _unsplit_output()


def _unsplit_output(m=4):
    """The unsplit model's output, one microbatch at a time as the pipeline runs it, in a rank (one thread): a
    GEMM over all 8 rows at once may round otherwise (seen with AVX-512 kernels)."""
    x = _batch()[0]
    with torch.no_grad():
        model = _model()
        return torch.cat([model([t.tensor_split(m)[i] for t in x]) for i in range(m)])


@pytest.mark.parametrize("schedule,recompute", [("1f1b", False), ("zbv", False), ("1f1b", True)])
def test_a_list_arrives_as_a_list_and_gradients_are_the_unsplit_models(schedule, recompute):
    # zbv: rank 1 holds stages 1 and 2, so a list also passes between two stages on one rank
    ranks = launch(_rank, 2, schedule, recompute, timeout=120)
    seen = {k: same for grads, _, _ in ranks for k, same in grads.items()}
    assert len(seen) == 16  # 4 Pair x 2 Linear x (weight, bias): every parameter is on some rank
    assert all(seen.values()), [k for k, same in seen.items() if not same]
    outputs = [(out, unsplit) for _, out, unsplit in ranks if out is not None]
    assert len(outputs) == 1 and outputs[0][0].shape == (8, 6)
    assert torch.equal(*outputs[0])


def _switching_rank(rank):
    model = _model()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=_loss, balance=[2, 3], timeout=60.0)
    x, y = _batch()
    pipe.step(x, target=y)
    model[1].kind = tuple  # stage 0's last layer: its output turns into a tuple with the same input
    try:
        pipe.step(x, target=y)
    except PipelineError as error:
        return str(error)
    finally:
        pipe.close()
    return None


def test_an_output_that_turns_from_list_to_tuple_is_named():
    ranks = launch(_switching_rank, 2, timeout=120)
    for rank in (0, 1):
        assert ranks[rank] is not None
        assert "the output of stage 0 was a list, is now a tuple" in ranks[rank]


def test_kinds_round_trip_through_the_meta_header():
    t = torch.zeros(2, 3)
    for batch, kind in ((t, TENSOR), ((t, t), TUPLE), ([t, t], LIST)):
        tensors, container = as_tuple(batch)
        assert container == kind
        rebuilt = as_value(tensors, container)
        assert type(rebuilt) is type(batch)
        assert decode_meta(encode_meta(meta_of(tensors, container)))[0] == kind
    assert describe_change("y", meta_of((t,), LIST), meta_of((t,), TUPLE)) == "y was a tuple, is now a list"
