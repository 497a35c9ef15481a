"""Activation recomputation: bitwise-equal gradients (Dropout included) and the memory it saves."""
import pytest

from rt_cases import SCHEDULES

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_recompute_gives_bitwise_equal_grads_with_dropout(two_ranks, schedule):
    for rank, results in enumerate(two_ranks):
        case = results[("recompute", schedule)]
        assert case == {"bitwise": True, "count": 8, "loss_equal": True, "has_r": True}, (rank, case)


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_measured_peak_equals_prediction_when_stages_do_not_save_their_input(two_ranks, schedule):
    for rank, results in enumerate(two_ranks):
        case = results[("memory-tanh-first", schedule)]
        for flag in (False, True):
            measured, predicted, in_timeline, _ = case[flag]
            assert measured == predicted == in_timeline, (rank, flag, case)
        if case["inflight"] > 1:
            assert case[True][0] < case[False][0], (rank, case)


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_measured_peak_equals_prediction_when_stages_save_their_input(two_ranks, schedule):
    """Linear first: the stage input is also saved by the stage, so the recompute re-saves a tensor
    already held; runtime and prediction (``recompute_bytes``) both count it once. The issue asks for
    10%; measured and predicted agree exactly."""
    for rank, results in enumerate(two_ranks):
        case = results[("memory", schedule)]
        assert case[False][0] == case[False][1], (rank, case)  # no recompute: exact
        measured, predicted, _, _ = case[True]
        assert measured == predicted, (rank, case)
        if case["inflight"] > 1:
            assert measured < case[False][0], (rank, case)
        else:
            assert measured <= case[False][0], (rank, case)
