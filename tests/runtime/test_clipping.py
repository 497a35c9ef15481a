"""Pipeline.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the unsplit model (2 and 4 gloo ranks).

Tolerances: the total norm and the clipped gradients within 1e-6 relative for finite norm types (the pipeline sums
per-rank p-th powers in float64, torch sums per-tensor norms in float32: the last bit may differ); the inf norm
bitwise where the gradients are (max is exact); gradients that are not clipped (coefficient clamped to 1) bitwise.
"""
import math

import pytest
import torch

from pipesched.runtime import launch

import rt_clipping

RTOL = 1e-6
NORM_TYPES = rt_clipping.NORM_TYPES


@pytest.fixture(scope="module")
def two():
    return launch(rt_clipping.two_rank_suite, 2, timeout=240)


@pytest.fixture(scope="module")
def four():
    return launch(rt_clipping.four_rank_suite, 4, timeout=240)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check_clipped(results, case, bitwise_grads: bool):
    totals = {}
    for rank, res in enumerate(results):
        for norm_type in NORM_TYPES:
            got = res[case]["clipped"][norm_type]
            assert got["form"] == ((), torch.float32, "cpu", False), got  # shape, dtype, device, requires_grad
            assert got["ref"] > 0 and rel(got["total"], got["ref"]) <= RTOL, (rank, norm_type, got)
            if norm_type == math.inf and bitwise_grads:
                assert got["total"] == got["ref"], (rank, got)
            assert got["count"] > 0 and got["nones"] == [] and got["worst"] <= RTOL, (rank, norm_type, got)
            # torch's own function on pipe.parameters() would have used this rank's norm only
            assert got["local"] <= got["total"]
            if norm_type != math.inf:
                assert (got["total"] - got["local"]) / got["total"] > RTOL, (rank, norm_type, got)
            totals.setdefault(norm_type, set()).add(got["total"])
        for norm_type in (2.0, math.inf):
            got = res[case]["unclipped"][norm_type]  # max_norm = 2 x the norm: coefficient clamped to 1
            assert rel(got["total"], got["ref"]) <= RTOL and got["worst"] <= RTOL, (rank, norm_type, got)
            if bitwise_grads:
                assert got["bitwise"], (rank, norm_type, got)
    assert all(len(values) == 1 for values in totals.values()), totals  # the same value on every rank


def test_tied_parameters_across_ranks_are_counted_once(two):
    # Embedding | Head share a weight, and three Linears across both ranks share another: torch's norm over the
    # unsplit model counts each once; counting both ranks' copies would give a clearly larger norm. Tied
    # gradients are summed in another order than the unsplit model's: 1e-5 relative (rt_tied.RTOL)
    for rank, res in enumerate(two):
        for norm_type in (2.0, 1.0, math.inf):
            got = res["tied"][norm_type]
            assert rel(got["total"], got["ref"]) <= 1e-5 and got["worst"] <= 1e-5, (rank, norm_type, got)
    assert two[0]["tied"][2.0]["total"] == two[1]["tied"][2.0]["total"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_two_ranks_match_the_unsplit_model(two, schedule):
    assert [res[schedule]["layout"] for res in two] == [(2, 1)] * 2
    check_clipped(two, schedule, bitwise_grads=True)


def test_four_pipeline_ranks_interleaved_match_the_unsplit_model(four):
    assert [res["interleaved-p4"]["layout"] for res in four] == [(4, 1)] * 4
    check_clipped(four, "interleaved-p4", bitwise_grads=True)


def test_data_parallel_replicas_are_not_counted_twice(four):
    # dp=2 x pp=2: reduced over the pipeline group only; a reduction over all 4 ranks would give sqrt(2) x the
    # 2-norm. The replicas' averaged gradients equal the reference's within 1e-6, not bitwise.
    assert [res["dp2xpp2"]["layout"] for res in four] == [(2, 2)] * 4
    check_clipped(four, "dp2xpp2", bitwise_grads=False)


def test_a_training_loop_with_clipping_follows_the_unsplit_model(two):
    # step, clip_grad_norm_(0.05), AdamW x 3 on 1F1B: each step clips (the norm is above 0.05), the loss is
    # bitwise the reference's, the norm within 1e-6 relative, weights within 1e-6 absolute
    for res in two:
        for loss_rel, norm_rel, clipped, weight_diff in res["loop"]:
            assert loss_rel == 0.0 and norm_rel <= RTOL and clipped and weight_diff <= 1e-6, res["loop"]


def test_gradients_that_are_none_are_skipped(two):
    # Linear, Linear | Detach, Linear (frozen), Linear: rank 0 has no gradient at all, rank 1 a frozen layer
    nones = {0: ["0.bias", "0.weight", "1.bias", "1.weight"], 1: ["3.bias", "3.weight"]}
    for rank, res in enumerate(two):
        for norm_type in (2.0, math.inf):
            got = res["none"][norm_type]
            assert got["nones"] == nones[rank] and got["worst"] <= RTOL, (rank, got)
            assert rel(got["total"], got["ref"]) <= RTOL and got["form"][1] == torch.float32, (rank, got)
    assert two[0]["none"][2.0]["total"] == two[1]["none"][2.0]["total"]


def test_the_norm_has_the_dtype_torch_gives_over_all_stages(two):
    # Linear (float64), cast | Linear (float32): float64 on both ranks, as torch's over the unsplit model
    for rank, res in enumerate(two):
        for norm_type in (2.0, math.inf):
            got = res["dtypes"][norm_type]
            assert got["form"] == ((), torch.float64, "cpu", False), (rank, got)
            assert rel(got["total"], got["ref"]) <= RTOL and got["worst"] <= RTOL, (rank, got)
        assert two[0]["dtypes"][2.0]["total"] == two[1]["dtypes"][2.0]["total"]


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_nonfinite_gradient_on_one_stage_raises_on_every_rank(two, bad, norm_type):
    # one gradient element of the last stage (rank 1) set to nan / inf: error_if_nonfinite=True raises on BOTH
    # ranks and leaves every gradient as it was; error_if_nonfinite=False returns torch's value (nan, inf) on both
    expect = (f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
              "be clipped (the norm over every stage of the pipeline; every rank raises this). To disable this error "
              "and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    for res in two:
        got = res["nonfinite"][(bad, norm_type)]
        assert got["raised"] == expect and got["unscaled"], got
        if bad == "nan":
            assert math.isnan(got["total"]) and math.isnan(got["ref"]), got
        else:
            assert got["total"] == got["ref"] == math.inf, got
        assert res["nonfinite"]["usable"]


BAD_MESSAGES = {
    "{'max_norm': 0.0}": "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got 0.0",
    "{'max_norm': -1}": "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got -1",
    "{'max_norm': '1.0'}": "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got '1.0'",
    "{'max_norm': nan}": "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got nan",
    "{'max_norm': True}": "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got True",
    "{'max_norm': 1.0, 'norm_type': 0}": "norm_type must be a number > 0 or inf (float('inf') or 'inf'), got 0",
    "{'max_norm': 1.0, 'norm_type': -2.0}": "norm_type must be a number > 0 or inf (float('inf') or 'inf'), got -2.0",
    "{'max_norm': 1.0, 'norm_type': -inf}": "norm_type must be a number > 0 or inf (float('inf') or 'inf'), got -inf",
    "{'max_norm': 1.0, 'norm_type': 'two'}":
        "norm_type must be a number > 0 or inf (float('inf') or 'inf'), got 'two'",
    "{'max_norm': 1.0, 'norm_type': None}": "norm_type must be a number > 0 or inf (float('inf') or 'inf'), got None",
    "{'max_norm': 1.0, 'error_if_nonfinite': 'yes'}": "error_if_nonfinite must be True or False, got 'yes'",
    "{'max_norm': 1.0, 'foreach': 1}": "foreach must be None, True or False, got 1",
    "{'max_norm': tensor([1.])}":
        "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got tensor([1.])",
    "{'max_norm': tensor(True)}":
        "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got tensor(True)",
    "{'max_norm': tensor(-1.)}":
        "max_norm must be a number > 0 or a 0-dim tensor holding one (inf: no clipping), got tensor(-1.)",
}


def test_bad_arguments_are_a_value_error_on_every_rank(two):
    for res in two:
        got = {k: v for k, v in res["bad"].items() if k != "valid"}
        assert got == {k: ("ValueError", message) for k, message in BAD_MESSAGES.items()}
        total, ref = res["bad"]["valid"]  # then a valid call (norm_type='inf', as torch takes it) is torch's value
        assert total == ref


MISMATCH_MESSAGES = {
    "norm_type": "clip_grad_norm_: the pipeline ranks passed different norm_type: 2.0 on pipeline rank(s) [0], inf "
                 "on pipeline rank(s) [1]; pass the same norm_type on every rank (no gradient was changed)",
    "max_norm": "clip_grad_norm_: the pipeline ranks passed different max_norm: 0.001 on pipeline rank(s) [0], "
                "1000.0 on pipeline rank(s) [1]; pass the same max_norm on every rank (no gradient was changed)",
    "max_norm, a tensor": "clip_grad_norm_: the pipeline ranks passed different max_norm: 0.0010000000474974513 on "
                          "pipeline rank(s) [0], 0.01 on pipeline rank(s) [1]; pass the same max_norm on every rank "
                          "(no gradient was changed)",
}


def test_ranks_passing_different_max_norm_or_norm_type_all_raise_and_keep_their_gradients(two):
    # rank 0 and rank 1 disagree: the same ValueError on both (not two different clippings), gradients bitwise
    # unchanged; afterwards the ranks are still in step (the tensor cases below run on the same pipeline)
    for res in two:
        for name, message in MISMATCH_MESSAGES.items():
            assert res["mismatched"][name] == ("ValueError", message, True), (name, res["mismatched"][name])


def test_a_0_dim_tensor_max_norm_is_taken_as_torch_takes_it(two):
    # max_norm = torch.tensor(unclipped norm / 3): total and gradients equal torch's on the unsplit model (RTOL)
    for res in two:
        for norm_type in (2.0, math.inf):
            got = res["mismatched"][("tensor", norm_type)]
            assert rel(got["total"], got["ref"]) <= RTOL and got["count"] > 0 and got["worst"] <= RTOL, got
            assert got["total"] > got["max_norm"] * 2.9, got  # the gradients were clipped


def test_a_closed_or_failed_pipeline_gives_the_error_step_gives(two):
    for res in two:
        got = res["closed_and_broken"]
        assert got[("closed", "clip")] == got[("closed", "step")] == ("RuntimeError: this Pipeline was closed; "
                                                                      "create a new one")
        assert got["failed"] == "PipelineError"
        assert got[("broken", "clip")] == got[("broken", "step")]
        assert got[("broken", "clip")].startswith("PipelineError: pipeline rank failure: world rank 1 (pipeline "
                                                  "rank 1) failed at instruction F1.0"), got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_reduction_runs_on_the_device_over_nccl():
    # one rank, so NCCL's pipeline group has one member; clipping twice: the second sees the clipped gradients
    got = launch(rt_clipping.cuda_case, 1, timeout=240)[0]
    for norm_type, (device, dtype, total, ref) in got.items():
        assert device == "cuda:0" and dtype == torch.float32 and rel(total, ref) <= RTOL, (norm_type, got)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_the_fallbacks_for_torch_before_2_6_compute_what_torch_does(norm_type):
    # torch 2.4-2.5 (accepted by the package) lack get_total_norm and clip_grads_with_norm_; the fallbacks must
    # give torch's norm (within 1e-6 relative: per-tensor kernels may differ from foreach ones) and its scaling
    from pipesched.runtime import clipping

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((3, 4), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    grads = [p.grad for p in params]
    total = clipping._norm_before_2_6(grads, norm_type)
    expect = torch.nn.utils.get_total_norm(grads, norm_type)
    assert total.dtype == expect.dtype == torch.float32 and rel(total.item(), expect.item()) <= RTOL
    before = [p.grad.clone() for p in params]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for twin, b in zip(twins, before):
        twin.grad = b.clone()
    clipping._scale_before_2_6(params, expect.item() / 4, expect)  # clips: coefficient about 1/4
    torch.nn.utils.clip_grads_with_norm_(twins, expect.item() / 4, expect)
    for p, twin, b in zip(params, twins, before):
        assert torch.equal(p.grad, twin.grad) and not torch.equal(p.grad, b)


def test_without_the_torch_2_6_functions_the_fallbacks_are_used(monkeypatch):
    from pipesched.runtime import clipping

    monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    monkeypatch.delattr(torch.nn.utils, "clip_grads_with_norm_")
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    total = clipping._norm_of([p.grad], 2.0, None)
    assert total.item() == 5.0
    clipping._scale([p], 1.0, total, None)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]) * torch.clamp(1.0 / (total + 1e-6), max=1.0))
