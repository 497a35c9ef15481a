"""Which boundaries get a gradient, and settings changed between steps, against the unsplit model (2 ranks)."""
import pytest

from pipesched.runtime import launch

import rt_gradients

OPTIONS = ((), ("split_backward",), ("recompute",))
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


@pytest.fixture(scope="module")
def results():
    return launch(rt_gradients.suite, 2, timeout=240)


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "split", "recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_detached_boundary_leaves_grad_none_upstream(results, schedule, options):
    # Linear, Linear | Detach, Linear, Linear: the first stage's weights get no gradient in the unsplit model,
    # so .grad stays None and AdamW's weight decay leaves them alone
    expect_none = {0: ["0.bias", "0.weight", "1.bias", "1.weight"], 1: []}
    if schedule == "interleaved-1f1b":  # stages [0], [1], [Detach], [3, 4]: rank 0 holds 0 and Detach
        expect_none = {0: ["0.bias", "0.weight"], 1: ["1.bias", "1.weight"]}
    for rank, res in enumerate(results):
        case = res[("detach", schedule, options)]
        assert case["steps"] == [(expect_none[rank], True, True)] * 2, (rank, case)
        assert case["weights_equal"] is True


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "split", "recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_tuple_element_the_next_stage_never_uses_gets_no_gradient(results, schedule, options):
    # Linear, TwoHeads(a, b) | First (uses a), Linear: TwoHeads.b's weights get no gradient
    expect_none = {0: ["1.b.bias", "1.b.weight"], 1: []}
    if schedule == "interleaved-1f1b":  # stages [0], [TwoHeads], [First], [3]: rank 1 holds TwoHeads
        expect_none = {0: [], 1: ["1.b.bias", "1.b.weight"]}
    for rank, res in enumerate(results):
        case = res[("tuple", schedule, options)]
        assert case["steps"] == [(expect_none[rank], True, True)] * 2, (rank, case)
        assert case["weights_equal"] is True


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "split", "recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_freezing_and_unfreezing_stage_0_between_steps(results, schedule, options):
    # step 1 frozen, 2 unfrozen, 3 frozen, 4 unfrozen in eval(): each step's loss and grads equal the unsplit
    # model's (frozen weights: .grad None on both)
    frozen = {"1f1b": ["0.0.bias", "0.0.weight", "1.0.bias", "1.0.weight"], "gpipe": None,
              "interleaved-1f1b": ["0.0.bias", "0.0.weight"]}
    frozen["gpipe"] = frozen["1f1b"]
    for rank, res in enumerate(results):
        steps = res[("freeze", schedule, options)]
        expect = (frozen[schedule] if rank == 0 else [], True, True)
        assert steps == [expect, ([], True, True), expect, ([], True, True)], (rank, steps)


def test_train_and_eval_mode_between_steps_re_learn_the_messages(results):
    # stage 0 sends (x, 2x) in training mode and (x,) in eval mode
    for res in results:
        assert res["eval"] == [(True, True)] * 3


def test_a_gradient_that_comes_on_some_steps_only_is_a_clear_error(results):
    for message in (res["data_dependent"] for res in results):
        assert ("the input gradients of stage 1 present [False] (True: a gradient, False: none), [True] before, "
                "with the same input signature and settings") in message, message


def test_ranks_that_call_step_and_forward_get_the_same_value_error(results):
    expect = ("every rank of a pipeline must make the same call; pipeline rank 0 called forward(), "
              "pipeline rank 1 called step()")
    for message, loss in (res["mixed_calls"] for res in results):
        assert message == expect
        assert loss > 0  # the pipeline stays usable


def test_a_step_under_no_grad_is_refused_on_every_rank_and_the_pipeline_stays_usable(results):
    expect = ("step() trains, but pipeline ranks [0, 1] called it with gradients disabled (inside torch.no_grad() "
              "or torch.inference_mode()); call step() outside it, or use forward() for evaluation")
    for res in results:
        assert res["no_grad"] == (expect, True)
