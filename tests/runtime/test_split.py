"""The split backward (I then W) gives bitwise the gradients of one fused backward, whatever the graph."""
import copy

import torch
from torch import nn

from pipesched.runtime.split import backward_input, backward_weight


def _fused_and_split(module, inputs, grads=None, loss=False):
    """Run ``module`` twice (a deep copy each), once with one backward, once split; return
    (input grads, param grads) of both. ``inputs``: tuple of tensors; floating ones get requires_grad."""
    results = []
    for split in (False, True):
        net = copy.deepcopy(module)
        xs = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in inputs)
        out = net(*xs)
        roots = [out.sum() if loss else out] if not isinstance(out, tuple) else list(out)
        given = None if loss else grads
        if split:
            got, work = backward_input(roots, given, xs, [p for p in net.parameters() if p.requires_grad])
            backward_weight(work)
        else:
            torch.autograd.backward(roots, given)
            got = tuple(x.grad for x in xs if x.requires_grad)  # None where no gradient reached an input
        results.append((got, [p.grad for p in net.parameters()]))
    return results


def bitwise(a, b):
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def test_an_mlp_chain_is_bitwise_over_accumulating_microbatches():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fused, split = copy.deepcopy(net), copy.deepcopy(net)
    for mb in range(3):  # the second and third accumulate into .grad like a fused backward does
        x, g = torch.randn(5, 8), torch.randn(5, 4)
        xa = x.clone().requires_grad_(True)
        fused(xa).backward(g)
        xb = x.clone().requires_grad_(True)
        got, work = backward_input([split(xb)], [g], [xb], list(split.parameters()))
        assert torch.equal(got[0], xa.grad)
        # before W no parameter has this microbatch's gradient yet
        if mb == 0:
            assert all(p.grad is None for p in split.parameters())
        backward_weight(work)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(fused.parameters(), split.parameters()))


class _Tied(nn.Module):
    """One Linear applied twice: its weight's gradient flows through two boundary nodes, one below the other."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_a_weight_used_twice_is_not_counted_twice():
    torch.manual_seed(1)
    (fused_in, fused_p), (split_in, split_p) = _fused_and_split(_Tied(), (torch.randn(3, 6),), [torch.randn(3, 6)])
    assert bitwise(fused_in, split_in) and bitwise(fused_p, split_p)


class _TwoHeads(nn.Module):
    """Two outputs: one from the input, one from a parameter alone (a root the input does not reach)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias_only = nn.Parameter(torch.randn(4))
        self.unused = nn.Parameter(torch.randn(2))

    def forward(self, x, ids):
        return self.lin(x) * (ids[:, None] + 1), self.bias_only * 3.0


def test_roots_outside_the_input_closure_int_inputs_and_unused_parameters():
    torch.manual_seed(2)
    inputs = (torch.randn(3, 4), torch.arange(3))
    grads = [torch.randn(3, 4), torch.randn(4)]
    (fused_in, fused_p), (split_in, split_p) = _fused_and_split(_TwoHeads(), inputs, grads)
    assert len(split_in) == 1  # the int64 ids get no gradient
    assert bitwise(fused_in, split_in) and bitwise(fused_p, split_p)
    names = [n for n, _ in _TwoHeads().named_parameters()]
    assert split_p[names.index("unused")] is None  # no gradient, as in a fused backward


def test_a_loss_root_with_no_input_needing_a_gradient_runs_whole_in_w():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 4)
    fused, split = copy.deepcopy(net), copy.deepcopy(net)
    fused(x).sum().backward()
    loss = split(x).sum()
    got, work = backward_input([loss], None, [x], list(split.parameters()))
    assert got == () and all(p.grad is None for p in split.parameters())
    backward_weight(work)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(fused.parameters(), split.parameters()))


def test_a_scalar_loss_root_with_an_input_gradient():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    (fused_in, fused_p), (split_in, split_p) = _fused_and_split(net, (torch.randn(5, 4),), loss=True)
    assert bitwise(fused_in, split_in) and bitwise(fused_p, split_p)


def test_an_input_no_root_depends_on_gets_none_not_zeros():
    # the unsplit model leaves .grad None there; a zero tensor would make the previous stage run its backward
    lin = nn.Linear(4, 4)
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    got, work = backward_input([lin(a)], [torch.ones(3, 4)], [a, b], list(lin.parameters()))
    assert got[0] is not None and got[1] is None
    backward_weight(work)
    assert lin.weight.grad is not None
    got, work = backward_input([], [], [a, b], list(lin.parameters()))  # no output got a gradient
    assert got == (None, None) and work.whole is None and work.groups == []
