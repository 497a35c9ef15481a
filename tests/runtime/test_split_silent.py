"""Four results the split backward (I then W) got silently wrong, now those of the fused backward bitwise:

- leaves that are not the stage's registered parameters (a loss_fn's own parameter, a tensor created with
  ``requires_grad=True``) got no gradient (or, under dualpipev, only the fused B's microbatches');
- a tensor hook on a Linear's output was applied twice to the weight gradients (at I and again at W);
- ``x.requires_grad_()`` on stage 0's rank got ``x.grad`` None;
- ``torch.utils.checkpoint(use_reentrant=False)`` recomputed its forward again at each W, updating BatchNorm's
  running statistics (and any buffer a forward changes) more often than the unsplit model.

First with ``backward_input``/``backward_weight`` alone (no ranks), then in a Pipeline on 2 ranks against the
unsplit model run one microbatch at a time."""
import copy

import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.split import SplitPlans, backward_input, backward_weight

import rt_split_silent


def _equal(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# ---- backward_input alone (no ranks) --------------------------------------------------------------------------

class _Extra(nn.Module):
    """Linear, times ``scale`` (an unregistered leaf that requires grad) on the input path and plus ``shift`` (one)
    on a branch of its own; the output of a second Linear."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = torch.linspace(0.5, 2.0, 4).requires_grad_(True)
        self.shift = torch.full((4,), 0.25, requires_grad=True)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) * self.scale) + self.shift * self.scale)


def test_leaves_that_are_not_parameters_get_the_fused_gradients_over_microbatches_and_the_plan_is_reused():
    torch.manual_seed(0)
    fused = _Extra()
    split, plans, temp = copy.deepcopy(fused), SplitPlans(), torch.tensor(0.7, requires_grad=True)
    temp_fused = temp.detach().clone().requires_grad_(True)
    for mb in range(3):  # the second and third accumulate into .grad as microbatches do
        x, target = torch.randn(3, 4), torch.randn(3, 4)
        ((fused(x.clone().requires_grad_(True)) * temp_fused - target) ** 2).mean().backward()
        xs = x.clone().requires_grad_(True)
        loss = ((split(xs) * temp - target) ** 2).mean()  # temp: a loss function's own parameter
        got, work = backward_input([loss], None, [xs], list(split.parameters()), plans)
        if mb == 0:  # I accumulates into no leaf
            assert split.scale.grad is None and split.shift.grad is None and temp.grad is None
        backward_weight(work)
    assert plans.hits == 2
    for name in ("scale", "shift"):
        assert getattr(fused, name).grad is not None and torch.equal(getattr(split, name).grad,
                                                                     getattr(fused, name).grad), name
    assert torch.equal(temp.grad, temp_fused.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(split.parameters(), fused.parameters()))
    assert xs.grad is None  # the input's gradient is returned by I, not accumulated


def test_a_leaf_that_changes_is_a_new_plan_or_the_new_tensor():
    torch.manual_seed(1)
    net, plans = _Extra(), SplitPlans()

    def once():
        xs = torch.randn(3, 4, requires_grad=True)
        _, work = backward_input([net(xs)], [torch.ones(3, 4)], [xs], list(net.parameters()), plans)
        backward_weight(work)

    once()
    old = net.shift
    net.shift = torch.full((4,), 0.25, requires_grad=True)  # another tensor at the same place: same shape, reused
    once()
    assert plans.hits == 1 and net.shift.grad is not None and torch.equal(net.shift.grad, old.grad)
    net.shift.requires_grad_(False)  # no longer a leaf of the graph: a new plan, and no gradient for it
    net.shift.grad = None
    once()
    assert plans.hits == 1 and net.shift.grad is None and net.scale.grad is not None


def test_a_tensor_hook_on_a_boundary_tensor_changes_the_weight_gradient_once():
    torch.manual_seed(2)

    class Halved(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            y = self.lin(x)
            y.register_hook(self.halve)
            return torch.tanh(y)

        def halve(self, g):
            self.calls += 1
            return g * 0.5

    fused = nn.Sequential(Halved(), Halved())
    split = copy.deepcopy(fused)
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    fused(xa).backward(g)
    got, work = backward_input([split(xb)], [g], [xb], list(split.parameters()))
    assert [m.calls for m in split] == [1, 1]
    backward_weight(work)
    assert torch.equal(got[0], xa.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(split.parameters(), fused.parameters()))
    assert [m.calls for m in fused] == [1, 1]
    assert [m.calls for m in split] == [2, 2]  # documented: the hook runs again at W (its result is not used)


# ---- in a Pipeline: 2 ranks -----------------------------------------------------------------------------------

#: case -> the tensors besides the model's parameters that must get a gradient, bitwise the unsplit model's
MUST_HAVE = {"loss_param": {"loss_fn.log_t", "2.gain"}, "hook": set(), "input_grad": {"x"}, "checkpoint_bn": set()}


@pytest.fixture(scope="module")
def results():
    return launch(rt_split_silent.suite, 2, timeout=300)


def test_every_case_is_covered():
    assert set(MUST_HAVE) == set(rt_split_silent.CASES)


def _merged(results, key, part):
    merged = {}
    for res in results:
        for name, pair in res[key][part].items():
            assert name not in merged, name  # held by one rank
            merged[name] = pair
    return merged


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", list(rt_split_silent.CONFIGS))
@pytest.mark.parametrize("case", list(rt_split_silent.CASES))
def test_gradients_are_the_unsplit_models_bitwise(results, case, config):
    ops = set().union(*(res[(case, config)]["ops"] for res in results))
    assert ({"I", "W"} <= ops) == (config != "1f1b"), ops
    for res in results:
        loss, ref = res[(case, config)]["loss"]
        assert torch.equal(loss, ref.reshape(())), (loss, ref)
    grads = _merged(results, (case, config), "grads")
    model = nn.Sequential(*rt_split_silent.CASES[case][0]())
    expected = {name for name, _ in model.named_parameters()} | MUST_HAVE[case]
    assert set(grads) == expected
    for name, (got, want) in grads.items():
        assert want is not None, name  # every one of them has a gradient in the unsplit model
        assert got is not None and torch.equal(got, want), (case, config, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", list(rt_split_silent.CONFIGS))
def test_a_checkpointed_forward_runs_twice_per_microbatch_as_unsplit(results, config):
    buffers = _merged(results, ("checkpoint_bn", config), "buffers")
    assert len(buffers) == 3 * 4  # 3 blocks: running_mean, running_var, num_batches_tracked, calls
    for name, (got, want) in buffers.items():
        if name.endswith(("num_batches_tracked", "calls")):
            # 2 microbatches x (the forward, the backward's recompute)
            assert int(want) == 2 * rt_split_silent.M and int(got) == int(want), (config, name, got, want)
        else:  # cumulative averages: only the order of the updates differs from the unsplit model's
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (config, name, got, want)
