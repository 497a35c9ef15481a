"""``Candidate.from_json`` refuses a key it does not know (``"split_backwards": true`` next to ``"split_backward":
false`` was dropped: the plan ran without split backward) and a bubble fraction outside [0, 1]; a schedule name it
does not know is taken (a plan may name a schedule registered in the process that planned it)."""
import json

import pytest

from pipesched.plan_result import Candidate
from pipesched.planner import plan
from pipesched.profile import LayerProfile

KEYS = ("schedule, pp, dp, num_microbatches, virtual_stages, balance, recompute, split_backward, microbatch_size, "
        "step_time, bubble_fraction, peak_memory, layer_names, costs")


def good() -> dict:
    return {"schedule": "1f1b", "pp": 2, "dp": 1, "num_microbatches": 4, "virtual_stages": 1, "balance": [3, 3],
            "recompute": [False, False], "split_backward": False, "microbatch_size": 2, "step_time": 0.5,
            "bubble_fraction": 0.25, "peak_memory": [1000, 900]}


@pytest.mark.parametrize("extra, message", [
    ({"split_backwards": True}, "planned candidate JSON: unknown key 'split_backwards' (did you mean "
                                f"'split_backward'?); a candidate's keys are {KEYS}"),
    ({"timeline": None, "zz": 1},
     f"planned candidate JSON: unknown keys 'timeline', 'zz'; a candidate's keys are {KEYS}"),
])
def test_an_unknown_key_is_refused_naming_it_and_the_closest_key(extra, message):
    with pytest.raises(ValueError) as info:
        Candidate.from_json({**good(), **extra})
    assert str(info.value) == message


def test_a_misspelled_key_is_named_before_the_key_it_leaves_missing():
    data = good()
    data["split_backwards"] = data.pop("split_backward")
    with pytest.raises(ValueError) as info:
        Candidate.from_json(data)
    assert str(info.value).startswith("planned candidate JSON: unknown key 'split_backwards' (did you mean "
                                      "'split_backward'?)")


@pytest.mark.parametrize("value", [2.0, 1.0000001])
def test_a_bubble_fraction_above_1_is_refused(value):
    with pytest.raises(ValueError) as info:
        Candidate.from_json(dict(good(), bubble_fraction=value))
    assert str(info.value) == (f"candidate field 'bubble_fraction' must be a fraction in [0, 1] (idle rank-seconds / "
                               f"(pp x step time)), got {value!r}")
    with pytest.raises(ValueError):  # the constructor checks it too
        Candidate(**{**good(), "balance": (3, 3), "recompute": (False, False), "peak_memory": (1000, 900),
                     "bubble_fraction": value})


@pytest.mark.parametrize("value", [0.0, 1.0, 1])
def test_bubble_fractions_0_and_1_are_taken(value):
    assert Candidate.from_json(dict(good(), bubble_fraction=value)).bubble_fraction == value


def test_an_unregistered_schedule_name_is_taken():
    assert Candidate.from_json(dict(good(), schedule="my-registered-schedule")).schedule == "my-registered-schedule"


def test_what_the_planner_writes_reads_back():
    profile = LayerProfile(forward=[1e-3] * 6, input_grad=[1e-3] * 6, weight_grad=[1e-3] * 6,
                           activation_bytes=[2 ** 23] * 6, output_bytes=[2 ** 20] * 6, param_bytes=[2 ** 22] * 6,
                           microbatch_size=1, layer_names=["Linear"] * 6)
    for candidate in plan(profile, 2, 1e9, 16, top=3):
        back = Candidate.from_json(json.loads(json.dumps(candidate.to_json())))
        assert back.to_json() == candidate.to_json() and 0 <= back.bubble_fraction <= 1
