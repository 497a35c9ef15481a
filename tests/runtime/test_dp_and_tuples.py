"""Data parallel with dp != p, and a stage output whose first element is a floating tensor that needs no
gradient, against the unsplit model (3 spawned gloo ranks)."""
import pytest

from pipesched.runtime import launch

import rt_dp_tuples
from rt_cases import SCHEDULES

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results():
    return launch(rt_dp_tuples.suite, rt_dp_tuples.WORLD, timeout=240)


@pytest.mark.parametrize("key", [("dp", s) for s, _ in SCHEDULES] + [("dp", "1f1b", "split_backward")],
                         ids=lambda key: "-".join(key[1:]))
def test_one_rank_pipelines_times_three_replicas_average_over_the_three(results, key):
    # p=1, dp=3: an average over a group of the wrong size (p, or any other count than 3) scales every gradient;
    # the mean of the replicas' gradients is the unsplit model's gradient on the whole batch (to rounding)
    for rank, res in enumerate(results):
        case = res[key]
        assert case["layout"] == (1, 3, rank), case
        assert case["grads"] == case["params"] == 16 and case["worst"] <= 1e-6, (rank, case)
        assert case["loss_equal"] is True, (rank, case)  # the replica's own loss


@pytest.mark.parametrize("options", rt_dp_tuples.OPTIONS, ids=["plain", "split", "recompute"])
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_a_non_grad_float_tensor_first_in_a_stage_output_leaves_gradients_bitwise(results, schedule, options):
    # stage 0 ends in ConstThenActivation -> (cos(x.detach()) / 2, tanh(Wx)); the next stage (on the next rank)
    # starts with UseBoth, which checks that element 0 arrives as a float without requires_grad
    stages = {"gpipe": [(0,), (1,), (2,)], "1f1b": [(0,), (1,), (2,)], "interleaved-1f1b": [(0, 3), (1, 4), (2, 5)]}
    for rank, res in enumerate(results):
        case = res[("tuple", schedule, options)]
        assert case["stages"] == stages[schedule][rank], case
        assert case["params"] > 0 and case["steps"] == [
            {"loss_equal": True, "grads": case["params"], "bitwise": True, "worst": 0.0}] * 2, (rank, case)


def test_a_parameter_only_one_replica_uses_is_averaged_and_one_none_uses_stays_none(results):
    # replica 1's data takes SignBranch's branch, replicas 0 and 2 do not; "0.never" is used by none: every replica
    # must hold the unsplit model's whole-batch gradient (replica 1's part / 3 for 0.used), and None for 0.never
    for rank, res in enumerate(results):
        case = res["unused"]
        assert case["ref_none"] == ["0.never.bias", "0.never.weight"], case
        assert case["none"] == case["ref_none"], (rank, case)
        assert case["used_nonzero"] is True and case["worst"] <= 1e-6, (rank, case)
