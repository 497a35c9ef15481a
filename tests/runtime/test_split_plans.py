"""A stage's split-backward analysis kept in a SplitPlans: reused while the graph keeps its shape, redone when it
changes, and the gradients bitwise those of one fused backward either way."""
import copy

import torch
from torch import nn

from pipesched.runtime.split import SplitPlans, backward_input, backward_weight

from test_split import bitwise  # None where None, else torch.equal, element by element


def _compare(module, calls, trainable=None):
    """Run ``calls`` ([(args, output grads)]) through two deep copies of ``module``: fused backward, and split
    with one SplitPlans kept across the calls (gradients accumulate over them, as over microbatches). Returns
    (fused input grads per call, split input grads per call, fused param grads, split param grads, plans).
    ``trainable(net)``: called on each copy before each call (to freeze parameters)."""
    fused, split, plans = copy.deepcopy(module), copy.deepcopy(module), SplitPlans()
    fused_in, split_in = [], []
    for k, (args, grads) in enumerate(calls):
        for net, split_it in ((fused, False), (split, True)):
            if trainable is not None:
                trainable(net, k)
            xs = tuple(a.clone().requires_grad_(a.is_floating_point()) for a in args)
            out = net(*xs)
            roots = list(out) if isinstance(out, tuple) else [out]
            if split_it:
                got, work = backward_input(roots, grads, xs, [p for p in net.parameters() if p.requires_grad],
                                           plans)
                backward_weight(work)
                split_in.append(got)
            else:
                torch.autograd.backward(roots, grads)
                fused_in.append(tuple(x.grad for x in xs if x.requires_grad))
    return fused_in, split_in, [p.grad for p in fused.parameters()], [p.grad for p in split.parameters()], plans


def test_a_chain_reuses_its_plan_every_microbatch_after_the_first():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    calls = [((torch.randn(5, 8),), [torch.randn(5, 4)]) for _ in range(4)]
    fused_in, split_in, fused_p, split_p, plans = _compare(net, calls)
    assert plans.hits == 3
    assert all(bitwise(a, b) for a, b in zip(fused_in, split_in))
    assert bitwise(fused_p, split_p) and all(g is not None for g in split_p)


class _Branchy(nn.Module):
    """A data-dependent graph: the second Linear runs once or twice, and the head's weight is used twice."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, twice):
        h = torch.tanh(self.a(x))
        for _ in range(int(twice.item()) + 1):
            h = torch.tanh(self.b(h))
        return self.head(torch.tanh(self.head(h)))


def test_a_graph_that_changes_shape_gets_a_new_plan_and_the_same_gradients():
    torch.manual_seed(1)
    pattern = (0, 0, 1, 1, 0, 1)  # shapes A A B B A B: reused 2 times (2nd, 4th)
    calls = [((torch.randn(3, 6), torch.tensor(t)), [torch.randn(3, 6)]) for t in pattern]
    fused_in, split_in, fused_p, split_p, plans = _compare(_Branchy(), calls)
    assert plans.hits == 2
    assert all(bitwise(a, b) for a, b in zip(fused_in, split_in))
    assert bitwise(fused_p, split_p)


def test_freezing_a_parameter_between_microbatches_is_a_new_plan():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def trainable(model, k):  # the first Linear's weight is frozen from the third call on
        model[0].weight.requires_grad_(k < 2)

    calls = [((torch.randn(2, 4),), [torch.randn(2, 4)]) for _ in range(4)]
    fused_in, split_in, fused_p, split_p, plans = _compare(net, calls, trainable)
    assert plans.hits == 2  # calls 2 and 4 reuse; call 3 (frozen now) does not
    assert all(bitwise(a, b) for a, b in zip(fused_in, split_in))
    assert bitwise(fused_p, split_p)


class _TwoHeads(nn.Module):
    """One output from the input, one from a parameter alone (a root outside the input closure)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.alone = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x), self.alone * 2.0


def test_a_root_outside_the_input_closure_with_a_kept_plan():
    torch.manual_seed(3)
    calls = [((torch.randn(3, 4),), [torch.randn(3, 4), torch.randn(4)]) for _ in range(3)]
    fused_in, split_in, fused_p, split_p, plans = _compare(_TwoHeads(), calls)
    assert plans.hits == 2
    assert all(bitwise(a, b) for a, b in zip(fused_in, split_in))
    assert bitwise(fused_p, split_p)


class _Sum(nn.Module):
    """``a(x) + b(x)``, or ``a(x) + b(c)`` with a constant ``c``: the same nodes at the same places, but in the
    second ``b`` no longer leads to the input, so its weight gradient restarts at the sum, not at ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, through_input):
        return self.a(x) + self.b(x if bool(through_input) else torch.ones(3, 4))


def test_the_same_nodes_with_another_edge_is_a_new_plan():
    torch.manual_seed(4)
    calls = [((torch.randn(3, 4), torch.tensor(t)), [torch.randn(3, 4)]) for t in (1, 0, 0, 1)]
    fused_in, split_in, fused_p, split_p, plans = _compare(_Sum(), calls)
    assert plans.hits == 1
    assert all(bitwise(a, b) for a, b in zip(fused_in, split_in))
    assert bitwise(fused_p, split_p) and all(g is not None for g in split_p)


def test_the_same_graph_with_the_parameters_in_another_order_is_a_new_plan():
    torch.manual_seed(5)
    fused = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    split, plans = copy.deepcopy(fused), SplitPlans()
    for order in (1, -1):  # forwards, then backwards
        x, g = torch.randn(3, 4), torch.randn(3, 2)
        fused(x.clone().requires_grad_(True)).backward(g)
        xs = x.clone().requires_grad_(True)
        _, work = backward_input([split(xs)], [g], [xs], list(split.parameters())[::order], plans)
        backward_weight(work)
    assert plans.hits == 0
    assert bitwise([p.grad for p in fused.parameters()], [p.grad for p in split.parameters()])
