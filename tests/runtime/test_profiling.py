"""profile_layers in one process: fields, exact bytes, no trace left on the model or the RNG."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.profile import LayerProfile
from pipesched.runtime import profile_layers
from pipesched.runtime.accounting import SavedBytes


class Pair(nn.Module):
    """Returns a tuple ``(x, 2x)``."""

    def forward(self, x):
        return x, 2 * x


class Sum(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), Pair(), Sum(), nn.Linear(8, 3))


def test_fields_of_a_small_model():
    torch.set_num_threads(1)
    model = small_model()
    prof = profile_layers(model, torch.randn(4, 6), torch.randn(4, 3), F.mse_loss, repeat=2, warmup=0, sizes=(2,))  # BatchNorm: not 1 row
    assert isinstance(prof, LayerProfile) and prof.num_layers == 6 and prof.microbatch_size == 4
    assert prof.layer_names == ("Linear", "BatchNorm1d", "Dropout", "Pair", "Sum", "Linear")
    assert prof.weight_grad[2:5] == (0.0, 0.0, 0.0)  # no parameters: W = 0
    assert all(t > 0 for t in prof.forward)
    assert prof.output_bytes == (4 * 8 * 4,) * 3 + (2 * 4 * 8 * 4, 4 * 8 * 4, 4 * 3 * 4)  # the tuple counts twice
    assert prof.param_bytes == ((6 * 8 + 8) * 4, 16 * 4, 0.0, 0.0, 0.0, (8 * 3 + 3) * 4)
    assert prof.input_bytes == 4 * 6 * 4 and prof.device == "cpu"
    assert prof.latency == 0.0 and prof.bandwidth == float("inf")


def test_bytes_of_a_linear_stack_are_what_the_accounting_counts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x = torch.randn(3, 5)
    prof = profile_layers(model, x, repeat=1, warmup=0)
    expected, inputs = [], x
    for layer in model:
        counter = SavedBytes(model.parameters())
        with counter.track():
            out = layer(inputs)
        expected.append(float(counter.take()))
        inputs = out.detach().requires_grad_()
    assert prof.activation_bytes == tuple(expected)
    assert prof.activation_bytes == (3 * 5 * 4, 3 * 7 * 4, 3 * 7 * 4)  # Linear saves its input, Tanh its output
    assert prof.output_bytes == (3 * 7 * 4, 3 * 7 * 4, 3 * 2 * 4)
    assert prof.input_grad[0] == 0.0 or prof.input_grad[0] < prof.weight_grad[0] + 1  # layer 0: input needs no grad


def test_leaves_no_trace_on_grads_buffers_and_rng():
    torch.set_num_threads(1)
    model, twin = small_model(), small_model()
    x, target = torch.randn(4, 6), torch.randn(4, 3)
    model[5].weight.grad = torch.full_like(model[5].weight, 3.0)  # an existing .grad stays as it was
    twin[5].weight.grad = torch.full_like(twin[5].weight, 3.0)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(7)
    profile_layers(model, x, target, F.mse_loss, repeat=2, warmup=1, sizes=(2,))
    out = model(x)  # dropout draws from the RNG: as if profiling never ran
    F.mse_loss(out, target).backward()
    torch.manual_seed(7)
    twin_out = twin(x)
    F.mse_loss(twin_out, target).backward()
    assert torch.equal(out, twin_out)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert model[1].num_batches_tracked.item() == 1  # one training forward after profiling
    model2 = small_model()
    profile_layers(model2, x, target, F.mse_loss, repeat=1, warmup=0, sizes=(2,))
    assert all(p.grad is None for p in model2.parameters())
    for key, value in before.items():
        assert torch.equal(small_model().state_dict()[key], value), key


def test_save_load_round_trip(tmp_path):
    prof = profile_layers(small_model(), torch.randn(4, 6), repeat=1, warmup=0, sizes=(2,))
    prof.save(tmp_path / "profile.json")
    assert LayerProfile.load(tmp_path / "profile.json") == prof


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(repeat=0), ValueError, r"repeat must be an int >= 1, got 0"),
    (dict(warmup=-1), ValueError, r"warmup must be an int >= 0, got -1"),
    (dict(loss_fn=3), TypeError, r"loss_fn must be callable, got int"),
    (dict(loss_fn=lambda out, y: (out - y).pow(2).mean()), ValueError,
     r"loss_fn takes \(output, target\) but target is None: pass target="),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        profile_layers(small_model(), torch.randn(4, 6), **kwargs)


def test_fixed_parts_of_a_small_model():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))
    prof = profile_layers(model, torch.randn(8, 6), torch.randn(8, 3), F.mse_loss, repeat=3, warmup=1)
    for name in ("forward", "input_grad", "weight_grad"):
        fixed, times = getattr(prof, name + "_fixed"), getattr(prof, name)
        assert len(fixed) == 5 and all(0.0 <= f <= t for f, t in zip(fixed, times)), name
    assert any(f > 0 for f in prof.forward_fixed)  # every op pays its dispatch, whatever the rows
    assert prof.weight_grad_fixed[1] == prof.weight_grad_fixed[3] == 0.0  # no parameters: W = 0
    flat = profile_layers(model, torch.randn(8, 6), sizes=(), repeat=1, warmup=0)
    assert flat.forward_fixed == flat.input_grad_fixed == flat.weight_grad_fixed == (0.0,) * 5


def test_fixed_parts_are_the_intercept_of_the_fitted_line():
    from pipesched.runtime.profiling import _fixed_parts

    timings = {1: [(3.0, 1.0, 0.5)], 2: [(4.0, 1.0, 0.4)], 4: [(6.0, 1.0, 2.0)]}  # F = 2 + s, I flat, W noisy
    fixed = _fixed_parts(timings, 4)
    assert fixed[0] == pytest.approx((2.0,), rel=1e-12) and fixed[1] == (1.0,)  # rel 1e-12: least-squares rounding
    assert fixed[2] == (0.0,)  # a negative intercept (W grows faster than linearly here) clips to 0
    assert _fixed_parts({4: [(6.0, 1.0, 2.0)]}, 4) == ((0.0,), (0.0,), (0.0,))  # one size: no line, 0
    assert _fixed_parts({1: [(5.0, 0.0, 0.0)], 4: [(4.0, 0.0, 0.0)]}, 4)[0] == (4.0,)  # clipped to the time


def test_a_model_that_cannot_run_one_row_warns_and_keeps_fixed_parts_at_zero():
    with pytest.warns(UserWarning, match=r"does not run on 1 of the sample's 4 rows"):
        prof = profile_layers(small_model(), torch.randn(4, 6), repeat=1, warmup=0)
    assert prof.forward_fixed == (0.0,) * 6
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel"):
        profile_layers(small_model(), torch.randn(4, 6), repeat=1, warmup=0, sizes=(1,))  # asked for: raised
    prof = profile_layers(small_model(), torch.randn(4, 6), repeat=1, warmup=0, sizes=(2,))
    assert all(0.0 <= f <= t for f, t in zip(prof.forward_fixed, prof.forward))


@pytest.mark.parametrize("sizes", [(0,), (5,), "2", (1.5,), (True,)])
def test_bad_sizes(sizes):
    with pytest.raises(ValueError, match=r"sizes must be ints in \[1, 4\] \(the sample's rows\), got"):
        profile_layers(small_model(), torch.randn(4, 6), sizes=sizes)
