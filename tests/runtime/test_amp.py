"""Mixed precision on 2 ranks: Pipeline(autocast=...) and GradScaler against the unsplit model under the same
torch.autocast per microbatch and torch.amp.GradScaler (bitwise), message bytes, and bad input."""
import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.amp import autocast_context, checked_autocast
from pipesched.runtime.settings import fingerprint

import rt_amp

pytestmark = pytest.mark.multiprocess

CASES = [(s, r) for s, _, r in rt_amp.CASES]
IDS = [f"{s}{'-recompute' if r else ''}" for s, r in CASES]


@pytest.fixture(scope="module")
def results():
    return launch(rt_amp.suite, 2, timeout=300)


@pytest.mark.parametrize("schedule, recompute", CASES, ids=IDS)
def test_bf16_autocast_loss_and_gradients_are_bitwise_the_unsplit_models(results, schedule, recompute):
    # same ops in the same dtypes: every step's loss (float32: mse_loss autocasts to float32) and gradient equal
    # the unsplit model's under torch.autocast("cpu", torch.bfloat16) per microbatch; weights after 3 AdamW steps
    for rank, res in enumerate(results):
        case = res[("bf16", schedule, recompute)]
        assert case["steps"] == [(True, torch.float32, True)] * 3, (rank, case)
        assert case["weights"] is True
        assert case["param_dtypes"] == [("torch.float32", "torch.float32")]  # parameters and grads stay float32


def test_fp16_autocast_without_a_scaler_is_bitwise_too(results):
    for res in results:
        case = res[("fp16 autocast", "1f1b", False)]
        assert case["steps"] == [(True, torch.float32, True)] * 3 and case["weights"] is True, case


def test_loss_fn_runs_under_the_autocast_and_gets_the_last_stage_output_in_its_dtype(results):
    # torch's advice: autocast the forward including the loss. 12 calls (4 microbatches x 3 steps; with recompute
    # the loss runs again in R, under autocast too) all see autocast on, bfloat16, a bfloat16 output
    for schedule, recompute in CASES:
        assert results[0][("bf16", schedule, recompute)]["loss_fn"] == []  # the last stage is on rank 1
        assert results[1][("bf16", schedule, recompute)]["loss_fn"] == [(True, torch.bfloat16, torch.bfloat16)]


def test_forward_runs_under_autocast(results):
    assert results[0]["forward"] is None
    assert results[1]["forward"] == (torch.bfloat16, True)


def test_bf16_activation_and_gradient_messages_are_half_the_float32_bytes(results):
    # 4 microbatches of (2, 16): float32 2*16*4 = 128 bytes, bfloat16 64, each way. While learning an activation
    # also carries the 4096-byte meta header and a gradient message 16 bytes (aligned): presence mask, dim order
    f32 = {f"SEND_F0.{mb}>1": 128 for mb in range(4)} | {f"SEND_B1.{mb}>0": 128 for mb in range(4)}
    bf16 = {k: v // 2 for k, v in f32.items()}
    for rank, res in enumerate(results):
        by = res["bytes"]
        assert by["None"]["gathered"] == f32 and by["torch.bfloat16"]["gathered"] == bf16
        sent_here = "SEND_F" if rank == 0 else "SEND_B"
        assert by["None"]["local"] == {k: v for k, v in f32.items() if k.startswith(sent_here)}
        assert by["torch.bfloat16"]["local"] == {k: v for k, v in bf16.items() if k.startswith(sent_here)}
        extra = 4096 if rank == 0 else 16
        assert by["torch.bfloat16"]["learning"] == {k: v + extra for k, v in bf16.items() if k.startswith(sent_here)}


@pytest.mark.parametrize("schedule, recompute", CASES, ids=IDS)
def test_an_overflow_on_one_stage_makes_every_rank_skip_and_halve_its_scale(results, schedule, recompute):
    # Boom (stage 0, rank 0) overflows the backward in step 2: only rank 0 sees an inf, yet both ranks skip
    # (weights bitwise unchanged) and halve the scale; every other step equals the unsplit model with
    # torch.amp.GradScaler bitwise (loss, unscaled gradients, weights), and the scale grows back after 2 steps
    for rank, res in enumerate(results):
        steps = res[("scaler", schedule, recompute)]
        assert [s["overflow_here"] for s in steps] == [False, rank == 0, False, False], (rank, steps)
        assert [s["skipped"] for s in steps] == [False, True, False, False], (rank, steps)
        assert [s["scale"] for s in steps] == [s["ref_scale"] for s in steps] == [1024.0, 512.0, 512.0, 1024.0]
        assert [(s["loss"], s["grads"], s["weights"]) for s in steps] == [
            (True, True, True), (True, None, True), (True, True, True), (True, True, True)], (rank, steps)


def test_a_fused_optimizer_that_checks_gradients_itself_skips_on_every_rank_too(results):
    # Adam(fused=True): GradScaler.step hands the (agreed) found_inf to the optimizer instead of unscale_
    for rank, res in enumerate(results):
        steps = res["fused"]
        assert [s["overflow_here"] for s in steps] == [False, rank == 0, False, False], (rank, steps)
        assert [(s["skipped"], s["scale"], s["ref_scale"], s["loss"], s["weights"]) for s in steps] == [
            (False, 1024.0, 1024.0, True, True), (True, 512.0, 512.0, True, True),
            (False, 512.0, 512.0, True, True), (False, 1024.0, 1024.0, True, True)], (rank, steps)


def test_unscale_then_clip_grad_norm_before_the_scaler_step(results):
    # step 4: scaler.unscale_(opt), pipe.clip_grad_norm_(1e-3) (clips: the norm is far above), scaler.step:
    # the norm within 1e-6 of torch's on the unsplit model, the weights within 1e-6 (relative to each tensor's max)
    for rank, res in enumerate(results):
        steps = res["clip"]
        assert [s["skipped"] for s in steps] == [False, True, False, False], (rank, steps)
        assert [s["weights"] for s in steps[:3]] == [True, True, True], (rank, steps)
        assert steps[3]["clip_total_rel"] <= 1e-6 and steps[3]["weights_rel"] <= 1e-6, (rank, steps)


def test_a_scaler_must_reach_pipe_step_on_every_rank(results):
    for res in results:
        misuse = res["misuse"]
        assert misuse["torch scaler"] == (
            "TypeError: scaler must be a pipesched.runtime.GradScaler built for this Pipeline (it agrees on an "
            "overflow across every rank), got torch.amp.grad_scaler.GradScaler")
        assert misuse["other pipe"] == ("ValueError: scaler was built for another Pipeline; build one per Pipeline: "
                                        "GradScaler(pipe)")
        assert misuse["not a pipe"] == "TypeError: pipe must be a pipesched.runtime.Pipeline, got Sequential"
        assert misuse["one rank"] == (
            "scaler: the ranks passed this GradScaler to pipe.step(..., scaler=...) in different numbers of steps: "
            "in 1 step on pipeline rank 0, in no step (scaler=None) on pipeline rank 1; pass it to pipe.step on every "
            "rank in every step")
        assert misuse["never"] == (
            "scaler: no pipe.step() got this GradScaler, so the gradients were never scaled; call "
            "pipe.step(x, target=y, scaler=scaler) before scaler.unscale_/step")
        assert misuse["usable"] is True


def test_torchs_own_unscale_error_on_one_rank_ends_every_rank_naming_it(results):
    # rank 1's float16 gradients: torch raises in unscale_ there; both ranks raise a PipelineError naming world
    # rank 1 and torch's message (rank 0 learns it from the record, not from a timeout)
    for res in results:
        message = res["unscale fails"]
        assert "world rank 1" in message and "Attempting to unscale FP16 gradients" in message, message


def test_a_bad_autocast_is_a_value_error_on_every_rank(results):
    for res in results:
        assert res["bad"] == "autocast must be None, torch.bfloat16 or torch.float16, got torch.float32"


def test_ranks_with_different_autocast_are_refused_at_construction(results):
    for rank, res in enumerate(results):
        assert res["mismatch"] == (
            f"world rank {1 - rank} built its Pipeline with autocast={str(torch.bfloat16 if rank else None)!r} but "
            f"world rank {rank} with autocast={str(torch.bfloat16 if rank == 0 else None)!r}; every rank must "
            f"construct Pipeline with the same arguments (and the same model)")


# ---- one process --------------------------------------------------------------------------------------

def test_checked_autocast_values():
    cpu = torch.device("cpu")
    assert checked_autocast(None, cpu) is None
    assert checked_autocast(torch.bfloat16, cpu) is torch.bfloat16
    assert checked_autocast(torch.float16, cpu) is torch.float16  # torch >= 2.4 autocasts to float16 on CPU
    for bad in (torch.float32, torch.float64, "bfloat16", True):
        with pytest.raises(ValueError) as info:
            checked_autocast(bad, cpu)
        assert str(info.value) == f"autocast must be None, torch.bfloat16 or torch.float16, got {bad!r}"


def test_the_settings_fingerprint_covers_the_autocast_the_stages_run_under():
    # the Pipeline's autocast overrides the caller's: equal fingerprints exactly when the stages run alike
    stages, cpu = {0: nn.Sequential(nn.Linear(2, 2))}, torch.device("cpu")
    plain, bf16, fp16 = (fingerprint(stages, cpu, dtype) for dtype in (None, torch.bfloat16, torch.float16))
    assert len({plain, bf16, fp16}) == 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fingerprint(stages, cpu) == bf16  # the caller's autocast, no Pipeline autocast
        assert fingerprint(stages, cpu, torch.float16) == fp16  # the Pipeline's wins
    with autocast_context(cpu, torch.bfloat16)():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_autocast_and_scaler():
    result = launch(rt_amp.one_gpu, 1, timeout=300)[0]
    for dtype in ("torch.bfloat16", "torch.float16"):  # (loss bitwise, skipped, scale, weights bitwise) per step
        assert result[dtype] == [(True, False, 1024.0, True), (True, True, 512.0, True)], result
