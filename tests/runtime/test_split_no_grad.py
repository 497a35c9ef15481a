"""Backward roots that do not require grad or have no grad_fn: the split backward (I then W) fails exactly as the
fused one does (torch's own error), and where the fused one succeeds it gives its gradients bitwise."""
import copy

import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.split import backward_input, backward_weight

import rt_split_no_grad

TORCH_ERROR = "element 0 of tensors does not require grad and does not have a grad_fn"


# ---- backward_input alone (no ranks) --------------------------------------------------------------------------

def _fused_error(roots, grads):
    with pytest.raises(RuntimeError) as info:
        torch.autograd.backward(roots, grads)
    return str(info.value)


@pytest.mark.parametrize("x_needs_grad", [True, False], ids=["input-needs-grad", "no-input-needs-grad"])
def test_a_root_without_grad_fn_gets_torchs_error_at_i_and_no_gradient(x_needs_grad):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4).requires_grad_(x_needs_grad)
    loss = lin(x).detach().sum()  # a detached loss: no grad_fn, does not require grad
    assert _fused_error([loss], None) == TORCH_ERROR
    with pytest.raises(RuntimeError) as info:
        backward_input([loss], None, [x], list(lin.parameters()))
    assert str(info.value) == TORCH_ERROR  # at I, also where W would have run the whole backward
    assert x.grad is None and all(p.grad is None for p in lin.parameters())


def test_the_error_names_the_same_root_as_the_fused_one():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    roots = [lin(x), torch.ones(3, 4)]  # the second: a leaf that does not require grad
    grads = [torch.ones(3, 4), torch.ones(3, 4)]
    fused = _fused_error(roots, grads)
    assert fused == "element 1 of tensors does not require grad and does not have a grad_fn"
    with pytest.raises(RuntimeError) as info:
        backward_input(roots, grads, [x], list(lin.parameters()))
    assert str(info.value) == fused
    assert all(p.grad is None for p in lin.parameters())


class _Roots(nn.Module):
    """Roots with no grad_fn (the parameter ``p`` itself) and roots outside the input's graph that another root's
    graph passes through (``a`` under ``a * 2``, ``a`` given twice)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin, self.p = kind, nn.Linear(4, 4), nn.Parameter(torch.randn(4))

    def forward(self, x):
        h, a = self.lin(x), self.p * 3
        return {"param": (h, self.p), "param_used_too": (h * self.p, self.p), "below_another": (h, a, a * 2),
                "twice": (h, a, a), "under_the_input_graph": (h + a, a)}[self.kind]


@pytest.mark.parametrize("kind", ["param", "param_used_too", "below_another", "twice", "under_the_input_graph"])
def test_leaf_and_nested_roots_get_the_fused_gradients_bitwise(kind):
    torch.manual_seed(0)
    fused = _Roots(kind)
    split = copy.deepcopy(fused)
    x = torch.randn(3, 4)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    outs = fused(xa)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(list(outs), grads)
    got, work = backward_input(list(split(xb)), grads, [xb], list(split.parameters()))
    backward_weight(work)
    assert torch.equal(got[0], xa.grad)
    for (name, a), b in zip(fused.named_parameters(), split.parameters()):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), name


# ---- in a Pipeline: 2 ranks, fused 1f1b against 1f1b split, zb-h1 and zbv --------------------------------------

#: case -> {config: (origin world rank, instruction)}: where the fused backward (B) and the split one (I) fail
ERRORS = {case: {"1f1b": (1, "B1.0"), "1f1b-split": (1, "I1.0"), "zb-h1": (1, "I1.0"), "zbv": (0, "I3.0")}
          for case in ("loss_detached", "output_detached", "output_fresh_leaf_recompute", "nothing_needs_grad",
                       "nothing_needs_grad_recompute")}
#: case -> parameters the fused backward leaves without a gradient
SUCCEEDS = {"middle_detached": {"0.weight", "0.bias"}, "leaf_output": set(), "param_output": set(),
            "param_output_recompute": set(), "stages_without_params_recompute": set()}


@pytest.fixture(scope="module")
def results():
    return launch(rt_split_no_grad.suite, 2, timeout=300)


def test_every_case_is_covered():
    assert set(ERRORS) | set(SUCCEEDS) == set(rt_split_no_grad.CASES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", list(rt_split_no_grad.CONFIGS))
@pytest.mark.parametrize("case", list(ERRORS))
def test_a_root_without_grad_fails_as_the_fused_backward_on_every_rank(results, case, config):
    origin, instr = ERRORS[case][config]
    for rank, res in enumerate(results):
        err = res[(case, config)]
        assert err["type"] == "PipelineError", (rank, err)
        assert (err["rank"], err["instr"]) == (origin, instr), (rank, err)
        assert err["cause"] == f"RuntimeError: {TORCH_ERROR}", (rank, err)
        assert (f"pipeline rank failure: world rank {origin} (pipeline rank {origin}) failed at instruction {instr} "
                f"(kind {instr[0]}, stage {instr[1]}, microbatch 0): RuntimeError: {TORCH_ERROR}") in err["message"]
        assert ("[reported to world rank " in err["message"]) == (rank != origin), (rank, err)


def _merged(res_per_rank, key):
    """{name: the gradient from the rank that holds the parameter, or None}, and the loss (equal on both ranks)."""
    names = res_per_rank[0][key]["grads"]
    grads = {}
    for name in names:
        held = [res[key]["grads"][name] for res in res_per_rank if res[key]["grads"][name] is not None]
        assert len(held) <= 1, name
        grads[name] = held[0] if held else None
    losses = [res[key]["loss"] for res in res_per_rank]
    assert torch.equal(losses[0], losses[1])
    return grads, losses[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["1f1b-split", "zb-h1", "zbv"])
@pytest.mark.parametrize("case", list(SUCCEEDS))
def test_where_the_fused_backward_succeeds_the_split_one_gives_its_gradients_bitwise(results, case, config):
    for res in results:
        assert res[(case, "1f1b")]["type"] is None, res[(case, "1f1b")]
        assert res[(case, config)]["type"] is None, res[(case, config)]
    ops = {c: set().union(*(res[(case, c)]["ops"] for res in results)) for c in ("1f1b", config)}
    assert "B" in ops["1f1b"] and "I" not in ops["1f1b"], ops
    assert {"I", "W"} <= ops[config], ops  # (stage 0, whose input needs no gradient, may run a B)
    assert ("R" in ops[config]) == case.endswith("_recompute"), ops
    fused, fused_loss = _merged(results, (case, "1f1b"))
    split, split_loss = _merged(results, (case, config))
    assert {name for name, g in fused.items() if g is None} == SUCCEEDS[case]
    assert torch.equal(split_loss, fused_loss)
    assert fused.keys() == split.keys()
    for name, g in fused.items():
        s = split[name]
        assert (g is None and s is None) or (g is not None and s is not None and torch.equal(g, s)), (case, config,
                                                                                                       name)
