"""CostModel's strict JSON form, and a Candidate's ``costs`` in its JSON form: a zb-auto candidate saved and read
back builds the program the plan simulated (before, its costs were dropped and the runtime measured others)."""
from __future__ import annotations

import json
import math
import re

import pytest

import pipesched as ps
from pipesched.cost import CostError, CostModel
from pipesched.plan_result import Candidate
from pipesched.planner import pipeline_kwargs
from pipesched.profile import LayerProfile
from pipesched.program_io import fingerprint

MiB = 2 ** 20
KEYS = ["forward", "backward", "input_grad", "weight_grad", "recompute", "latency", "bandwidth", "activation_bytes",
        "grad_bytes", "stash_bytes", "input_bytes", "recompute_bytes", "tie_bytes", "send_overhead"]


def through_json(data):
    """``data`` written and read as strict JSON (no NaN or Infinity)."""
    return json.loads(json.dumps(data, allow_nan=False))


# ---- CostModel round trip ------------------------------------------------------------------------------------

def test_default_costs_round_trip_with_every_field():
    data = CostModel().to_json_dict()
    assert list(data) == KEYS
    assert data == {"forward": 1.0, "backward": 2.0, "input_grad": None, "weight_grad": None, "recompute": None,
                    "latency": 0.0, "bandwidth": "inf", "activation_bytes": 0.0, "grad_bytes": 0.0,
                    "stash_bytes": None, "input_bytes": None, "recompute_bytes": None, "tie_bytes": 0.0,
                    "send_overhead": 0.0}
    assert CostModel.from_json_dict(through_json(data)) == CostModel()


ALL_SET = CostModel(forward=[1.0, 2.5, 0.125], backward=[2, 5, 0.25], input_grad=[1, 2, 0.1], weight_grad=0.5,
                    recompute=[0.9, 2.4, 0.1], latency=1e-4, bandwidth=1.25e9, activation_bytes=[4 * MiB, MiB, 7],
                    grad_bytes=3 * MiB, stash_bytes=[5 * MiB, 2 * MiB, 9], input_bytes=[MiB, MiB, 3],
                    recompute_bytes=[6 * MiB, 3 * MiB, 9], tie_bytes=[0, 0, 123], send_overhead=2e-5)


@pytest.mark.parametrize("costs", [
    CostModel(),
    ALL_SET,
    CostModel(forward=[1, 2, 3, 4], backward=[2, 4, 6, 8.5]),
    CostModel(bandwidth=math.inf, latency=0.5),
    CostModel(bandwidth=1),
    CostModel(input_grad=1.5),  # weight_grad left to its default (backward - input_grad)
    CostModel(forward=0.1 + 0.2, backward=1 / 3),  # floats kept to the last bit
], ids=["defaults", "all-set", "per-stage", "inf-bandwidth", "bandwidth-1", "one-optional", "floats"])
def test_round_trip_gives_an_equal_cost_model(costs):
    data = through_json(costs.to_json_dict())
    back = CostModel.from_json_dict(data)
    assert back == costs and back.to_json_dict() == data
    for name in KEYS:  # per-stage lists stay lists (held as tuples), one number one number, None stays None
        value = getattr(costs, name)
        assert isinstance(data[name], list) == isinstance(value, tuple), name
        assert type(getattr(back, name)) is type(value) and (data[name] is None) == (value is None), name


def test_all_set_json_shape():
    data = ALL_SET.to_json_dict()
    assert data["forward"] == [1.0, 2.5, 0.125] and data["weight_grad"] == 0.5 and data["bandwidth"] == 1.25e9
    assert isinstance(data["stash_bytes"], list) and None not in data.values()


def test_left_out_keys_take_the_defaults():
    assert CostModel.from_json_dict({}) == CostModel()
    assert CostModel.from_json_dict({"forward": [1, 2], "bandwidth": 1e9}) == CostModel(forward=(1, 2), bandwidth=1e9)
    assert CostModel.from_json_dict({"input_grad": None}) == CostModel()


# ---- CostModel refusals --------------------------------------------------------------------------------------

REFUSED = [
    ([1.0], ValueError, "CostModel JSON: a cost model is a JSON object (as CostModel.to_json_dict writes), got "
                        "list [1.0]"),
    ({"forwrd": 1}, ValueError, "CostModel JSON: unknown key 'forwrd' (did you mean 'forward'?); a CostModel's keys "
                                "are " + ", ".join(KEYS)),
    ({"forward": "1"}, CostError, "CostModel JSON: cost forward must be a number or a sequence of numbers (one per "
                                  "stage, in stage order: a list, tuple or 1-d array), got '1'"),
    ({"backward": [1, "2"]}, CostError, "CostModel JSON: cost backward must be a finite number >= 0 (seconds), got "
                                        "'2'"),
    ({"activation_bytes": -1}, CostError, "CostModel JSON: cost activation_bytes must be a finite number >= 0 "
                                          "(bytes), got -1"),
    ({"forward": True}, CostError, "CostModel JSON: cost forward must be a number or a sequence of numbers (one per "
                                   "stage, in stage order: a list, tuple or 1-d array), got True"),
    ({"forward": None}, CostError, "CostModel JSON: cost forward must be a finite number >= 0 (seconds), got None "
                                   "(only input_grad, weight_grad, recompute, stash_bytes, input_bytes, "
                                   "recompute_bytes may be None: they have defaults)"),
    ({"latency": [1, 2]}, CostError, "CostModel JSON: cost latency must be a finite number >= 0 (seconds), got "
                                     "[1, 2]"),
    ({"grad_bytes": 1e400}, CostError, "CostModel JSON: cost grad_bytes must be a finite number >= 0 (bytes), got "
                                       "inf"),  # json reads 1e400 as inf
    ({"bandwidth": "Infinity"}, CostError, "CostModel JSON: cost bandwidth must be a number of bytes/s > 0 or "
                                           "\"inf\" (free transfers), got 'Infinity'"),
    ({"bandwidth": None}, CostError, "CostModel JSON: cost bandwidth must be a number of bytes/s > 0 or \"inf\" "
                                     "(free transfers), got None"),
    ({"bandwidth": 0}, CostError, "CostModel JSON: cost bandwidth must be a number of bytes/s > 0 or \"inf\" (free "
                                  "transfers), got 0"),
    ({"bandwidth": [1e9]}, CostError, "CostModel JSON: cost bandwidth must be a number of bytes/s > 0 or \"inf\" "
                                      "(free transfers), got [1e9]".replace("1e9", "1000000000.0")),
    ({"input_bytes": 5, "recompute_bytes": 4}, CostError, "CostModel JSON: cost recompute_bytes (4 for stage 0) must "
                                                          "be >= input_bytes (5): what a stage holds after its R "
                                                          "includes its input"),
]


@pytest.mark.parametrize("data, error, message", REFUSED, ids=[str(d) for d, _, _ in REFUSED])
def test_refusals_name_the_key_the_value_and_what_is_valid(data, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$") as info:
        CostModel.from_json_dict(json.loads(json.dumps(data)) if isinstance(data, dict) else data)
    if error is CostError:  # the field named, for a front end's own option name
        assert info.value.field == message.removeprefix("CostModel JSON: cost ").split()[0]


# ---- Candidate.costs in the JSON form ------------------------------------------------------------------------

def zb_auto_profile():
    f = [1e-3, 4e-3, 1e-3, 1e-3]
    return LayerProfile(forward=f, input_grad=f, weight_grad=f, activation_bytes=[8 * MiB] * 4, output_bytes=[MiB] * 4,
                        param_bytes=[MiB, MiB, 20 * MiB, 20 * MiB], microbatch_size=1, layer_names=["Linear"] * 4,
                        bandwidth=2e9, latency=1e-5)


@pytest.fixture(scope="module")
def zb_auto():
    c = ps.plan(zb_auto_profile(), 2, 180 * MiB, 8, schedules=["zb-auto"], top=1).best
    assert c.schedule == "zb-auto" and c.costs is not None
    return c


def compiled(kwargs: dict, pp: int):
    """What ``Pipeline(**kwargs)`` compiles on ``pp`` pipeline ranks."""
    return ps.compile_program(kwargs["schedule"], pp, kwargs["num_microbatches"], kwargs["virtual_stages"],
                              dp_size=kwargs["dp_size"], recompute=kwargs["recompute"],
                              split_backward=kwargs["split_backward"], costs=kwargs["costs"],
                              memory_limit=kwargs["memory_limit"])


def test_zb_auto_candidate_keeps_its_costs_through_json(zb_auto):
    data = through_json(zb_auto.to_json())
    assert data["costs"] == zb_auto.costs.to_json_dict() and list(data)[-1] == "costs"
    back = Candidate.from_json(data)
    assert back == zb_auto and back.costs == zb_auto.costs and back.to_json() == data
    kwargs, again = pipeline_kwargs(zb_auto, 4, 2, ["Linear"] * 4), pipeline_kwargs(back, 4, 2, ["Linear"] * 4)
    assert again == kwargs and again["costs"] == zb_auto.costs and again["memory_limit"] == [2, 2]
    program = compiled(again, back.pp)  # the very program the plan simulated: its step time to the bit
    assert fingerprint(program) == fingerprint(compiled(kwargs, zb_auto.pp))
    assert ps.simulate(program, again["costs"]).makespan == zb_auto.step_time


def test_a_plan_with_inf_bandwidth_is_strict_json():
    c = ps.plan(LayerProfile(forward=[1e-3] * 4, input_grad=[1e-3] * 4, weight_grad=[1e-3] * 4,
                             activation_bytes=[MiB] * 4, output_bytes=[MiB] * 4, param_bytes=[MiB] * 4,
                             microbatch_size=1), 2, 1e9, 8, schedules=["zb-auto", "1f1b"], top=2)
    assert all(math.isinf(x.costs.bandwidth) for x in c)
    data = through_json(c.to_json())  # allow_nan=False: no Infinity written
    assert {x["costs"]["bandwidth"] for x in data["candidates"]} == {"inf"}
    assert [Candidate.from_json(x).costs for x in data["candidates"]] == [x.costs for x in c]


def test_json_without_costs_still_loads_with_costs_none(zb_auto):
    old = {k: v for k, v in through_json(zb_auto.to_json()).items() if k != "costs"}
    for data in (old, dict(old, costs=None)):
        back = Candidate.from_json(data)
        assert back.costs is None and back == zb_auto and "costs" not in back.to_json()
        kwargs = pipeline_kwargs(back, 4, 2)
        assert "costs" not in kwargs and kwargs["memory_limit"] == [2, 2]  # the runtime measures them


def test_candidate_refuses_bad_costs_naming_them(zb_auto):
    good = through_json(zb_auto.to_json())
    S = zb_auto.pp * zb_auto.virtual_stages
    with pytest.raises(ValueError, match=re.escape("planned candidate JSON: unknown key 'cost' (did you mean "
                                                   "'costs'?); a candidate's keys are schedule, pp, dp, ")):
        Candidate.from_json({**{k: v for k, v in good.items() if k != "costs"}, "cost": good["costs"]})
    with pytest.raises(ValueError, match="^" + re.escape("planned candidate JSON: costs: a cost model is a JSON "
                                                         "object (as CostModel.to_json_dict writes), got str 'x'")):
        Candidate.from_json(dict(good, costs="x"))
    with pytest.raises(ValueError, match="^" + re.escape("planned candidate JSON: costs: unknown key 'forwards' "
                                                         "(did you mean 'forward'?)")):
        Candidate.from_json(dict(good, costs={**good["costs"], "forwards": 1}))
    with pytest.raises(CostError, match="^" + re.escape(f"planned candidate JSON: costs: cost forward has 1 values "
                                                        f"but the program has {S} stages (pp x virtual_stages = "
                                                        f"{zb_auto.pp} x {zb_auto.virtual_stages})") + "$"):
        Candidate.from_json(dict(good, costs={**good["costs"], "forward": [1.0]}))
    with pytest.raises(CostError, match="^" + re.escape("planned candidate JSON: costs: cost bandwidth must be a "
                                                        "number of bytes/s > 0 or \"inf\" (free transfers), got -1")):
        Candidate.from_json(dict(good, costs={**good["costs"], "bandwidth": -1}))
