"""Gradient-accumulation fusion (``runtime/wgrad_fusion.py``): ``W`` adds a ``Linear``'s weight gradient into its
existing ``.grad`` with one ``addmm_``. Which groups it takes and declines (every decline leaves autograd's path,
bitwise), values equal to autograd's to rounding, and a Pipeline with it on 2 forked gloo ranks against the
unsplit model."""
import contextlib

import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.split import SplitPlans, backward_input, backward_weight

import rt_wgrad_fusion as rt


def _microbatches(stage, fuse, shape, count=3, seed=0, context=contextlib.nullcontext):
    """``count`` microbatches of ``stage`` (input of ``shape`` requiring grad, as a stage > 0's) through I then W,
    from ``.grad`` None; returns each parameter's gradient."""
    g = torch.Generator().manual_seed(seed)
    stage.zero_grad(set_to_none=True)
    plans, params = SplitPlans(), [p for p in stage.parameters() if p.requires_grad]
    for _ in range(count):
        x = torch.randn(*shape, generator=g).requires_grad_()
        with context():
            y = stage(x)
        _, work = backward_input([y], [torch.randn(y.shape, generator=g)], [x], params, plans)
        backward_weight(work, fuse)
    return [p.grad.clone() for p in params]


def _run(stage, shape, **kw):
    """(unfused grads, fused grads, {"fused": n, "declined": n}) for the same microbatches."""
    plain = _microbatches(stage, False, shape, **kw)
    with rt.counted() as calls:
        fused = _microbatches(stage, True, shape, **kw)
    return plain, fused, calls


def _linears(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6, bias=bias), nn.Tanh(), nn.Linear(6, 5, bias=bias))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)], ids=["2d", "3d"])
def test_every_linear_form_is_fused_after_the_first_microbatch(bias, shape):
    plain, fused, calls = _run(_linears(bias), shape)
    # 2 Linears x 3 microbatches: the first finds .grad None (autograd's path: it sets .grad), the others fuse
    assert calls == {"fused": 4, "declined": 2}
    for a, b in zip(plain, fused):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    if bias:  # the bias keeps autograd's path: bitwise
        assert torch.equal(plain[1], fused[1]) and torch.equal(plain[3], fused[3])


def test_many_rows_equal_to_rounding():
    plain, fused, calls = _run(_linears(), (600, 8), count=4)
    assert calls == {"fused": 6, "declined": 2}
    for a, b in zip(plain, fused):  # sums of 2400 products of order 1: float32 rounding, relative to the largest
        assert float((b - a).abs().max()) <= 1e-5 * float(a.abs().max()), float((b - a).abs().max())


def test_off_is_never_asked():
    with rt.counted() as calls:
        _microbatches(_linears(), False, (4, 8))
    assert calls == {"fused": 0, "declined": 0}


class Twice(nn.Module):
    """One Linear applied twice: its weight's gradient comes from two GEMMs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def _hooked(kind):
    stage = _linears()
    seen = []
    if kind == "tensor":
        stage[0].weight.register_hook(lambda g: seen.append(1))
    else:
        stage[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    return stage, seen


@pytest.mark.parametrize("kind", ["tensor", "post-accumulate"])
def test_a_hooked_weight_keeps_autograds_path(kind):
    stage, seen = _hooked(kind)
    plain = _microbatches(stage, False, (4, 8))
    assert len(seen) == 3
    with rt.counted() as calls:
        fused = _microbatches(stage, True, (4, 8))
    assert len(seen) == 6  # each microbatch's W ran the hook once, as without fusion
    assert calls == {"fused": 2, "declined": 4}  # only the unhooked Linear fuses (after the first microbatch)
    assert torch.equal(plain[0], fused[0]) and torch.equal(plain[1], fused[1])


@pytest.mark.parametrize("make, shape", [
    (Twice, (3, 4)),
    (lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh()), (2, 2, 6)),
], ids=["weight-used-twice", "conv"])
def test_what_is_no_single_linear_gemm_keeps_autograds_path(make, shape):
    torch.manual_seed(0)
    plain, fused, calls = _run(make(), shape)
    assert calls["fused"] == 0 and calls["declined"] >= 3
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))


def test_an_autocast_cast_between_weight_and_gemm_keeps_autograds_path():
    def bf16():
        return torch.autocast("cpu", torch.bfloat16)
    plain, fused, calls = _run(_linears(), (4, 8), context=bf16)
    assert calls["fused"] == 0 and calls["declined"] == 6
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_a_non_contiguous_grad_keeps_autograds_path():
    stage = _linears()
    stage.zero_grad(set_to_none=True)
    with rt.counted() as calls:
        _microbatches(stage, True, (4, 8), count=1)
        grad = stage[0].weight.grad
        stage[0].weight.grad = grad.t().contiguous().t()  # same values, column-major: autograd keeps the layout
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 8, generator=g).requires_grad_()
        y = stage(x)
        _, work = backward_input([y], [torch.randn(y.shape, generator=g)], [x], list(stage.parameters()))
        backward_weight(work, True)
    assert calls == {"fused": 1, "declined": 3}  # the second Linear fused; the column-major .grad declined
    assert stage[0].weight.grad.stride() == (1, 6)


@pytest.mark.multiprocess
def test_pipeline_with_fusion_matches_the_unsplit_model():
    results = launch(rt.suite, 2, timeout=240, start_method="fork")
    for rank, got in enumerate(results):
        for name in ("zbv", "zb-h1", "zbv-rows", "1f1b", "zbv-recompute"):
            case = got[name]["case"]
            for step in case["steps"]:
                assert step["loss_equal"] is True or name == "zbv-rows", (name, step)
                assert step["grads"] > 0 and step["worst"] < 1e-5, (name, step)
            if name == "1f1b":  # the program's B, run as I then W inside it
                assert "B" in case["ops"] and not {"I", "W"} & set(case["ops"]), case["ops"]
            else:
                assert {"I", "W"} <= set(case["ops"]) and "B" not in case["ops"]
            assert ("R" in case["ops"]) is (name == "zbv-recompute"), case["ops"]
        # zbv, 8 Linears in 4 stages of 2: rank 0 holds stages 0 (its W is the whole backward: no group) and 3,
        # rank 1 stages 1 and 2; each split stage's first W of a step finds .grad None; 3 steps of m = 4
        split_stages = (1, 2)[rank]
        assert got["zbv"]["calls"] == {"fused": 3 * 2 * split_stages * 3, "declined": 3 * 2 * split_stages}
        assert got["zbv-rows"]["calls"] == got["zbv-recompute"]["calls"] == got["zbv"]["calls"]
        # zb-h1: rank 0's one stage is stage 0 (no groups); rank 1's stage 1 holds 4 Linears
        assert got["zb-h1"]["calls"] == ({"fused": 0, "declined": 0}, {"fused": 36, "declined": 12})[rank]
        assert got["1f1b"]["calls"] == got["zb-h1"]["calls"]  # the same stages: its B splits as zb-h1's I, W
        assert got["off"]["calls"] == {"fused": 0, "declined": 0}
        assert all(s["bitwise"] for s in got["off"]["case"]["steps"]) and got["off"]["case"]["params_equal"]
        assert got["refused"] == "Pipeline: gradient_accumulation_fusion must be True or False, got str 'yes'"
        assert got["property"] is True
