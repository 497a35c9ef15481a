"""Pipeline(balance="time", profile=...) and profile_link on 2 ranks (one launch)."""
import re

import pytest

from pipesched.partition import balance_by_time
from pipesched.runtime import launch

import rt_balance_time


@pytest.fixture(scope="module")
def results():
    return launch(rt_balance_time.suite, 2, timeout=240)


def test_the_partitioner_sees_the_skew():
    # per layer 1, 1, 2, 1, 8, 3 seconds: 4 | 2 layers is 5 | 11 seconds; the even 3 | 3 would be 4 | 12
    assert balance_by_time(rt_balance_time.SECONDS, 2) == (4, 2)


@pytest.mark.parametrize("schedule", [s for s, _ in rt_balance_time.CASES])
def test_balance_time_cuts_as_the_partitioner_and_keeps_the_gradients(results, schedule):
    # the even cuts would be (3, 3) and (2, 2, 1, 1): ranks 4 | 12, 10 | 6 (looped) and 5 | 11 (V) seconds
    expected = {"1f1b": (4, 2), "interleaved-1f1b": (1, 3, 1, 1), "zbv": (3, 1, 1, 1)}  # 5 | 11, 9 | 7, 7 | 9
    for rank, res in enumerate(results):
        case = res[schedule]
        assert case["balance"] == case["expected"], (rank, case)
        if schedule in expected:
            assert case["balance"] == expected[schedule]
        assert case["loss_equal"] is True and case["grads"] == (True, True), (rank, case)
    assert results[0][schedule]["balance"] == results[1][schedule]["balance"]


def test_balance_time_without_or_with_a_wrong_profile_is_refused_on_every_rank(results):
    for res in results:
        kind, message = res["no profile"]
        assert kind == "ValueError" and "balance='time' needs profile=" in message
        assert "pipesched.runtime.profile_layers" in message
        assert res["other model"] == ("ValueError", "profile has 5 layers but the model has 6: the profile is of "
                                      "another model (profile the model with pipesched.runtime.profile_layers)")
        assert res["other classes"] == ("ValueError", "profile's layer 1 is a Linear but the model's is a Tanh: the "
                                        "profile is of another model")


def test_profile_link_is_positive_and_the_same_on_both_ranks(results):
    (lat0, bw0, o0), (lat1, bw1, o1) = results[0]["link"], results[1]["link"]
    assert lat0 >= 0 and bw0 > 0 and o0 > 0  # the latency from the send call's end: 0 when the call was all of it
    assert (lat0, bw0, o0) == (lat1, bw1, o1)


def test_a_profile_with_another_balance_is_refused_not_ignored():
    from torch import nn

    from pipesched.runtime.stage import resolve_balance
    from rt_balance_time import hand_profile

    layers = [nn.Linear(2, 2), nn.Tanh()] * 3
    for balance in (None, "params", [3, 3]):
        with pytest.raises(ValueError, match=re.escape(f"profile= is used only with balance='time' (the cut it "
                                                       f"decides), got balance={balance!r}: pass balance='time', "
                                                       f"or drop profile=")):
            resolve_balance(layers, 2, balance, hand_profile())
    assert resolve_balance(layers, 2, None) == (3, 3)
