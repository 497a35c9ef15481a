"""A step that ONE rank gets wrong is refused on every rank, at once, and the pipeline stays usable.

Before, a rank's own checks of its call (no ``loss_fn``; a ``scaler=`` that is not this Pipeline's ``GradScaler``)
raised on that rank before it joined the step's opening all-gather, so a rank whose call was right waited in the
all-gather until the timeout. Now each rank's refusal travels in its row of the opening (runtime/handshake.py,
``judge_own_checks``): every rank raises the refusing rank's exception type with ``pipeline rank R refused its
step: <its message>``; where every rank refused alike, each raises its own message, as before. The target, x,
no_grad and step/forward verdicts already travelled in the opening; they are pinned here for one rank too.

2 ranks (rt_one_rank_bad_call.py): rank 1 alone passes the bad value; then a correct step on both ranks gives the
unsplit model's loss. Pipeline timeout 60 s: a regression shows as the waiting rank's own timeout error (a
PipelineError naming itself), which the expected messages refuse; nothing here is timed."""
from __future__ import annotations

import pytest

from pipesched import compile_program, step_programs
from pipesched.runtime import launch
from pipesched.runtime.handshake import REPLICA_MARK
from pipesched.runtime.refusals import OWN_REFUSAL, SIG_LEN, Rejected, encode_text, judge_own_checks, kind_code

import dry_run
import rt_one_rank_bad_call
from dry_run import DryPipeline

pytestmark = pytest.mark.multiprocess

TORCH_SCALER = ("scaler must be a pipesched.runtime.GradScaler built for this Pipeline (it agrees on an overflow "
                "across every rank), got torch.amp.grad_scaler.GradScaler")
OTHER_PIPE = "scaler was built for another Pipeline; build one per Pipeline: GradScaler(pipe)"
NO_LOSS_FN = "step() needs a loss_fn; pass loss_fn= to Pipeline (forward() needs none)"
NO_TARGET = "step() needs target on the rank of the last stage (pipeline rank 1): loss_fn takes (output, target)"
LAST = "the rank of the last stage (pipeline rank 1) rejected the step's target: "
NO_X = "the rank of stage 0 (pipeline rank 0) got no input x; pass the batch as x there"

#: case -> (what rank 0 raises, what rank 1 raises)
EXPECTED = {
    "torch scaler": (f"TypeError: pipeline rank 1 refused its step: {TORCH_SCALER}",) * 2,
    "another pipeline's scaler": (f"ValueError: pipeline rank 1 refused its step: {OTHER_PIPE}",) * 2,
    "no loss_fn": (f"ValueError: pipeline rank 1 refused its step: {NO_LOSS_FN}",) * 2,
    "no target": (f"ValueError: {LAST}{NO_TARGET}", f"ValueError: {NO_TARGET}"),
    "target not a tensor": (
        f"ValueError: {LAST}target must be a tensor or a non-empty tuple or list of tensors, got str",
        "ValueError: target must be a tensor or a non-empty tuple or list of tensors, got str"),
    "target batch size": (f"ValueError: {LAST}target has batch size 3 but x has 8",
                          "ValueError: target has batch size 3 but x has 8"),
    "gradients disabled": (
        "ValueError: step() trains, but pipeline ranks [1] called it with gradients disabled (inside torch.no_grad() "
        "or torch.inference_mode()); call step() outside it, or use forward() for evaluation",) * 2,
    "forward instead of step": ("ValueError: every rank of a pipeline must make the same call; pipeline rank 0 "
                                "called step(), pipeline rank 1 called forward()",) * 2,
    # x on the rank of stage 1 only: stage 0's rank (0) has none, and says so on both ranks
    "x on rank 1 only": (f"ValueError: {NO_X}",
                         f"ValueError: the rank of stage 0 (pipeline rank 0) rejected the step input: {NO_X}"),
    # each rank's scaler is bad in its own way: the first refusing rank's error, naming the other
    "bad scalers on both ranks": (
        f"TypeError: pipeline rank 0 refused its step (pipeline ranks [1] refused theirs too): {TORCH_SCALER}",) * 2,
    # the same bad argument on every rank: each rank's own error, as before the opening carried it
    "torch scaler on both ranks": (f"TypeError: {TORCH_SCALER}",) * 2,
    # Python raised these before step()'s body ran, so rank 0 waited in the opening and rank 1, catching the
    # error, ran its next step against rank 0's current one (the losses of mismatched batches, no error)
    "misspelled keyword": (
        "TypeError: pipeline rank 1 refused its step: Pipeline.step() got an unexpected keyword argument "
        "'targets'",) * 2,
    "one argument too many": (
        "TypeError: pipeline rank 1 refused its step: Pipeline.step() too many positional arguments",) * 2,
    "forward() misspelled keyword": (
        "TypeError: pipeline rank 1 refused its forward(): Pipeline.forward() got an unexpected keyword argument "
        "'batch'",) * 2,
    # its stages would run in bf16 and the others' in fp32: a loss neither model gives (it ran, before)
    "autocast on rank 1 only": (
        "ValueError: step() was called under different autocast settings: pipeline rank 0 without autocast, "
        "pipeline rank 1 under torch.autocast('cpu', dtype=torch.bfloat16); enter the same torch.autocast on every "
        "rank, or pass autocast= to Pipeline (then the caller's is ignored)",) * 2,
}


@pytest.fixture(scope="module")
def results():
    return launch(rt_one_rank_bad_call.bad_calls, 2, timeout=600)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_every_rank_raises_the_same_error_type_naming_the_rank_and_the_argument(results, case):
    for rank, res in enumerate(results):
        outcome, untouched, _, _ = res["cases"][case]
        assert outcome == EXPECTED[case][rank], (rank, case)
        assert untouched, (rank, case)  # refused before any work: no gradient anywhere
    assert len({r["cases"][case][0].split(":")[0] for r in results}) == 1  # one exception type on both ranks


@pytest.mark.parametrize("case", list(EXPECTED))
def test_the_next_correct_step_gives_the_unsplit_models_loss(results, case):
    for rank, res in enumerate(results):
        _, _, loss, expected = res["cases"][case]
        assert isinstance(loss, float), (rank, case, loss)
        assert abs(loss - expected) <= 1e-6 * abs(expected), (rank, case, loss, expected)


def test_a_step_refused_on_another_rank_does_not_count_on_the_scaler(results):
    # rank 0 passed its GradScaler to the step rank 1 refused ("torch scaler"): not counted, so the scaler's
    # collective step after one scaled step on both ranks agrees (else: "different numbers of steps")
    for res in results:
        assert res["scaled step"] == ("ok", 1)


def test_the_pipeline_whose_step_was_refused_still_runs(results):
    # "bare" has no loss_fn on rank 1: its step() is refused on both ranks, its forward() is the unsplit model's
    assert [res["bare forward"] for res in results] == [True, True]


# ---- the ruling itself, without processes ------------------------------------------------------------------

def _block(exc=None) -> list[int]:
    return [0] * SIG_LEN if exc is None else encode_text([OWN_REFUSAL, kind_code(type(exc)), 0], str(exc))


def _rulings(refusals: list) -> list:
    """What each rank raises, ``(kind, message, cause is its own refusal)``, or None."""
    blocks = [_block(exc) for exc in refusals]
    out = []
    for rank, exc in enumerate(refusals):
        try:
            judge_own_checks(blocks, rank, exc)
            out.append(None)
        except Rejected as rejected:
            out.append((rejected.kind, str(rejected), rejected.__cause__ is exc and exc is not None))
    return out


def test_the_ruling_on_the_ranks_own_checks():
    assert _rulings([None, None, None]) == [None, None, None]
    bad = TypeError("scaler must be ...")
    one = (TypeError, "pipeline rank 1 refused its step: scaler must be ...")
    assert _rulings([None, bad, None]) == [one + (False,), one + (True,), one + (False,)]
    alike = [ValueError("no loss_fn"), ValueError("no loss_fn")]
    assert _rulings(alike) == [(ValueError, "no loss_fn", True)] * 2
    mixed = [None, ValueError("first"), TypeError("second")]
    first = (ValueError, "pipeline rank 1 refused its step (pipeline ranks [2] refused theirs too): first")
    assert _rulings(mixed) == [first + (False,), first + (True,), first + (False,)]
    assert kind_code(TypeError) == 2 and kind_code(ValueError) == 1 and kind_code(Rejected) == 1


def test_a_replica_that_refused_with_a_type_error_is_a_type_error_on_the_others(monkeypatch):
    real = dry_run._FakeDP.allgather

    def other_refuses(self, outputs, inputs):
        work = real(self, outputs, inputs)
        train = int(inputs[0][1])
        outputs[0][1].copy_(inputs[0].new_tensor(encode_text([REPLICA_MARK, train, 2], "bad scaler")))
        return work

    monkeypatch.setattr(dry_run._FakeDP, "allgather", other_refuses)
    pipe = DryPipeline(step_programs(compile_program("1f1b", 2, 2, dp_size=2)))
    with pytest.raises(RuntimeError) as info:
        pipe.run(True)
    rejected = info.value.__cause__
    assert isinstance(rejected, Rejected) and rejected.kind is TypeError
    assert str(rejected) == "replica 1 refused its step: bad scaler"
