"""profile_layers' bytes per stage (LayerProfile.costs) equal what stage_activation_bytes measures for the same cut,
to the byte: a tensor saved by two layers of one stage (a Tanh's output, the next Linear's input) counts once."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched import CostModel, compile_program
from pipesched.memory import peak_activation_bytes
from pipesched.runtime import profile_layers, stage_activation_bytes


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): saves its input (LayerNorm), not its output."""

    def __init__(self, width):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Split(nn.Module):
    """(x, tanh(x)): passes its input on as the first of a tuple (same address), saves the new second."""

    def forward(self, x):
        return x, torch.tanh(x)


class Mul(nn.Module):
    """pair[0] * pair[1]: saves both."""

    def forward(self, pair):
        return pair[0] * pair[1]


def tanh_blocks():
    return nn.Sequential(*[layer for _ in range(3) for layer in (nn.Linear(8, 8), nn.Tanh())])


def gelu_blocks():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), Block(16), Block(16),
                         nn.Linear(16, 4))


def nothing_shared():
    """A GELU saves its input (not saved by the Linear before), a Linear its input (not saved by the GELU)."""
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.25), nn.Linear(8, 4))


def views_and_tuples():
    """ReLU's output passes through Flatten (a view at its address) and Identity to the Linear that saves it
    again; Tanh's output passes through Split (in a tuple) to Mul, which saves it again."""
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Flatten(), nn.Identity(), nn.Linear(8, 8), nn.Tanh(),
                         Split(), Mul(), nn.Linear(8, 3))


def frozen_prefix():
    """Nothing before the last Linear needs a gradient (parameterless, then frozen): those layers save nothing,
    as the next stage's input does not require grad either (the runtime sends requires_grad along)."""
    model = nn.Sequential(nn.Tanh(), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model[2].requires_grad_(False)
    return model


MODELS = {"tanh_blocks": (tanh_blocks, (4, 8), (4, 8)), "gelu_blocks": (gelu_blocks, (4, 8), (4, 4)),
          "nothing_shared": (nothing_shared, (4, 8), (4, 4)), "views_and_tuples": (views_and_tuples, (4, 2, 4), (4, 3)),
          "frozen_prefix": (frozen_prefix, (4, 8), (4, 4))}


def balances(n, stages):
    for cut in itertools.combinations(range(1, n), stages - 1):
        yield [b - a for a, b in zip((0,) + cut, cut + (n,))]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("with_loss", [False, True])
def test_profile_costs_equal_the_measured_stage_bytes(name, with_loss):
    make, shape, target_shape = MODELS[name]
    torch.manual_seed(0)
    model, x, target = make(), torch.randn(*shape), torch.randn(*target_shape)
    loss = dict(loss_fn=F.mse_loss, target=target) if with_loss else {}
    profile = profile_layers(model, x, repeat=1, warmup=0, sizes=(), **loss)
    n = len(model)
    checked = 0
    for stages in (1, 2, 3):
        for balance in balances(n, stages):
            measured = stage_activation_bytes(model, x, stages, balance=balance, **loss)
            costs = profile.costs(balance)
            assert costs.stash_bytes == measured["stash_bytes"], balance
            assert costs.input_bytes == measured["input_bytes"], balance
            assert costs.recompute_bytes == measured["recompute_bytes"], balance
            checked += 1
    assert checked == 1 + (n - 1) + (n - 1) * (n - 2) // 2


def test_what_is_shared():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    tanh = profile_layers(tanh_blocks(), x, repeat=1, warmup=0, sizes=())
    t = 4 * 8 * 4  # bytes of one (4, 8) float tensor
    assert tanh.activation_bytes == (t,) * 6
    assert tanh.boundary_saves == ((0, 0, ((0, t),)), (2, 2, ((1, t), (2, t))), (4, 4, ((3, t), (4, t))))
    assert tanh.costs([3, 3]).stash_bytes == (2 * t, 2 * t)  # summed per layer: 3 t each
    plain = profile_layers(nothing_shared(), x, repeat=1, warmup=0, sizes=())
    assert all(len(saves) == 1 for _, _, saves in plain.boundary_saves)  # one layer saves each: no correction
    assert plain.costs([3, 3]).stash_bytes == (sum(plain.activation_bytes[:3]), sum(plain.activation_bytes[3:]))
    chain = profile_layers(views_and_tuples(), torch.randn(4, 2, 4), repeat=1, warmup=0, sizes=())
    relu_out = next(entry for entry in chain.boundary_saves if entry[2][0][0] == 1)
    assert relu_out == (2, 4, ((1, t), (4, t)))  # through Flatten and Identity to the Linear
    tanh_out = next(entry for entry in chain.boundary_saves if entry[2][0][0] == 5)
    assert tanh_out == (6, 7, ((5, t), (7, t)))  # through Split (first of its tuple) to Mul


def test_predicted_peak_is_the_measured_one():
    torch.manual_seed(0)
    model, x = tanh_blocks(), torch.randn(4, 8)
    profile = profile_layers(model, x, repeat=1, warmup=0, sizes=())
    measured = CostModel(**stage_activation_bytes(model, x, 2, balance=[3, 3]))
    for recompute in (False, True):
        program = compile_program("1f1b", 2, 4, recompute=recompute)
        assert peak_activation_bytes(program, profile.costs([3, 3])) == peak_activation_bytes(program, measured)
    assert peak_activation_bytes(compile_program("1f1b", 2, 4), profile.costs([3, 3]))[0] == 2 * 2 * 4 * 8 * 4


def test_in_place_layers_are_profiled_on_a_copy_and_counted_as_a_stage_holds_them():
    # nn.ReLU(inplace=True) alone gets a leaf input, which autograd refuses to change in place; inside a stage it
    # changes the previous Linear's output. Every cut where no stage starts with it (Pipeline refuses those)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4), nn.ReLU(inplace=True),
                          nn.Linear(4, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    profile = profile_layers(model, x, target=y, loss_fn=F.mse_loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(t > 0 for t in profile.forward)
    expected = {(2, 3): (192, 320), (4, 1): (256, 192), (2, 2, 1): (192, 192, 192), (5,): (384,)}
    for balance, stash in expected.items():
        measured = stage_activation_bytes(model, x, len(balance), list(balance), loss_fn=F.mse_loss, target=y)
        assert tuple(measured["stash_bytes"]) == stash
        assert profile.costs(list(balance)).stash_bytes == tuple(float(b) for b in stash)
