"""The planner's inputs, from a new user's trial: ``layer_names`` alone is checked against the profile, a Candidate
carries the profile's layer names (``from_plan`` refuses other layer classes), ``virtual_stages`` and ``predict``'s
sizes are validated up front, a Candidate's JSON fields are type-checked, a tie reads as one, ``argument`` names the
argument of every planner ValueError, and ``pipesched plan --json`` prints JSON when nothing fits."""
import json

import pytest

from pipesched.cli import main
from pipesched.planner import Candidate, PlanError, pipeline_kwargs, plan, predict
from pipesched.profile import LayerProfile

MiB = 2**20


def profile6(names=("Sequential",) * 6) -> LayerProfile:
    L = 6
    return LayerProfile(forward=[1e-3] * L, input_grad=[1e-3] * L, weight_grad=[1e-3] * L,
                        activation_bytes=[8 * MiB] * L, output_bytes=[MiB] * L, param_bytes=[4 * MiB] * L,
                        microbatch_size=1, latency=1e-5, bandwidth=1e9, layer_names=list(names))


def refused(call, exc=ValueError):
    with pytest.raises(exc) as info:
        call()
    return info.value


# ---- 1. layer names -------------------------------------------------------------------------------------------

def test_layer_names_alone_are_checked_against_the_profile():
    p = profile6()
    err = refused(lambda: plan(p, 2, 1e9, 16, layer_names=["Linear"] * 6))
    assert str(err) == ("layer_names: profile's layer 0 is a Sequential but the model's is a Linear: the profile is "
                        "of another model")
    assert err.argument == "layer_names"
    err = refused(lambda: plan(p, 2, 1e9, 16, layer_names=["Sequential"] * 3))
    assert "profile has 6 layers but the model has 3" in str(err) and err.argument == "layer_names"
    err = refused(lambda: plan(p, 2, 1e9, 16, num_layers=6, layer_names=["Sequential"] * 3))
    assert str(err) == "layer_names has 3 names but num_layers=6: give one class name per layer"
    err = refused(lambda: plan(p, 2, 1e9, 16, num_layers=5))
    assert err.argument == "num_layers" and "profile has 6 layers but the model has 5" in str(err)
    assert plan(p, 2, 1e9, 16, layer_names=["Sequential"] * 6, top=1).best.layer_names == ("Sequential",) * 6


def test_a_candidate_carries_the_layer_names_through_json():
    p = profile6()
    best = plan(p, 2, 1e9, 16, top=1).best
    assert best.layer_names == ("Sequential",) * 6
    data = json.loads(json.dumps(best.to_json()))
    assert data["layer_names"] == ["Sequential"] * 6
    back = Candidate.from_json(data)
    assert back == best and back.layer_names == best.layer_names
    for c in (best, back):  # a Candidate is checked as a Plan is
        err = refused(lambda: pipeline_kwargs(c, 6, 2, ["Linear"] * 6))
        assert str(err) == ("the plan's layer 0 is a Sequential but the model's is a Linear: the plan is for another "
                            "model")
        assert pipeline_kwargs(c, 6, 2, ["Sequential"] * 6)["balance"] == list(best.balance)
    err = refused(lambda: pipeline_kwargs(best, 6, 2, ["Sequential"] * 3))
    assert str(err) == "layer_names has 3 names but num_layers=6: give one class name per layer"
    # old JSON (no layer_names) still loads, checked by layer count only
    old = {k: v for k, v in data.items() if k != "layer_names"}
    assert Candidate.from_json(old).layer_names == ()
    assert pipeline_kwargs(Candidate.from_json(old), 6, 2, ["Linear"] * 6)["schedule"] == best.schedule
    # a profile without names: the JSON form is what it was (no layer_names key)
    assert "layer_names" not in plan(profile6(names=()), 2, 1e9, 16, top=1).best.to_json()


def test_from_plan_refuses_a_candidate_of_other_layer_classes():
    torch = pytest.importorskip("torch")
    from pipesched.runtime import Pipeline

    best = plan(profile6(), 1, 1e9, 16, top=1).best  # one rank: nothing launched, refused before anything runs
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    err = refused(lambda: Pipeline.from_plan(model, Candidate.from_json(best.to_json())))
    assert str(err) == "the plan's layer 0 is a Sequential but the model's is a Linear: the plan is for another model"


# ---- 2. virtual_stages -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [(0,), (-1,), 0, (), "2", (2.0,), (True,), 2.5])
def test_virtual_stages_must_be_integers_of_at_least_1(value):
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, schedules=["interleaved-1f1b"], virtual_stages=value))
    assert str(err) == (f"virtual_stages must be an integer >= 1 or a non-empty sequence of them (e.g. 2 or (2, 4)), "
                        f"got {value!r}")
    assert err.argument == "virtual_stages"


@pytest.mark.parametrize("value", [(1,), 1, (1, 2)])
def test_v_1_only_for_an_interleaved_schedule_is_refused_naming_it(value):
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, schedules=["interleaved-1f1b"], virtual_stages=value))
    assert str(err) == (f"virtual_stages={value!r}: v = 1 is asked for but schedule 'interleaved-1f1b' runs v >= 2 "
                        f"stages per rank (v = 1 is another schedule's program, e.g. 1f1b): give virtual_stages >= 2, "
                        f"e.g. (2, 4), or leave it out of schedules")
    assert err.argument == "virtual_stages"
    # named with 1f1b too: still refused (interleaved-1f1b would get no v)
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, schedules=["1f1b", "interleaved-1f1b"], virtual_stages=(1,)))
    assert "schedule 'interleaved-1f1b' runs v >= 2" in str(err)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_a_fixed_schedule_does_not_run_is_refused_naming_it(schedule):
    # was: ignored, the plan came back with v = 2 (a new user's trial), while interleaved-1f1b's was refused
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, schedules=[schedule], virtual_stages=1))
    assert str(err) == (f"virtual_stages=1: no schedule asked for runs it: {schedule!r} runs exactly v = 2 stages per "
                        f"rank; leave virtual_stages out, or name a schedule that takes any v (interleaved-1f1b)")
    assert err.argument == "virtual_stages"
    # the plain schedules run v = 1 (they were ignoring a v of 4, as zbv and 1f1b together did)
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, schedules=[schedule, "1f1b"], virtual_stages=4))
    assert str(err).startswith(f"virtual_stages=4: no schedule asked for runs it: {schedule!r} runs exactly v = 2, "
                               f"'1f1b' runs v = 1 stages per rank")
    assert plan(profile6(), 2, 1e9, 16, schedules=[schedule], virtual_stages=(1, 2)).best.virtual_stages == 2
    # named with a schedule the v fits: each runs its own (the README's "fixed ones use theirs")
    assert plan(profile6(), 2, 1e9, 16, schedules=[schedule, "1f1b"], virtual_stages=1).best is not None


def test_v_1_with_the_default_schedules_leaves_interleaved_out():
    result = plan(profile6(), 2, 1e9, 16, virtual_stages=1, top=50)
    assert "interleaved-1f1b" not in {c.schedule for c in result}
    assert {c.virtual_stages for c in result if c.schedule in ("zbv", "dualpipev")} == {2}  # fixed: theirs


def test_an_int_is_one_v():
    result = plan(profile6(), 2, 1e9, 16, schedules=["interleaved-1f1b"], virtual_stages=3, top=50)
    assert {c.virtual_stages for c in result} == {3}


def test_v_above_the_layer_count_is_refused():
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, schedules=["interleaved-1f1b"], virtual_stages=(100,)))
    assert str(err) == ("virtual_stages=(100,): v=100 stages per rank need pp x 100 >= 100 layers for every pp, but "
                        "the model has 6 (schedule 'interleaved-1f1b'): give virtual stages <= 6")
    assert err.argument == "virtual_stages"
    err = refused(lambda: plan(profile6(), 2, 1e9, 16, virtual_stages=(2, 7)))
    assert "v=7 stages per rank" in str(err)


def test_schedules_that_run_no_pp_are_named_not_the_batch():
    # world 4, global batch 2: dp must divide 2, so pp = 2 (dp 2) or 4 (dp 1); v=4 needs 8 or 16 of the 6 layers
    err = refused(lambda: plan(profile6(), 4, 1e9, 2, schedules=["interleaved-1f1b"], virtual_stages=4))
    assert str(err).startswith("schedules ['interleaved-1f1b'] run none of pp = 2, 4 (pp x dp = world_size=4, dp "
                               "dividing global_batch=2, pp x v <= 6 layers, v in virtual_stages=[4]")
    assert err.argument == "schedules"
    err = refused(lambda: plan(profile6(), 16, 1e9, 3))
    assert "global_batch=3" in str(err) and "divisible by" in str(err) and err.argument == "global_batch"


# ---- 3. predict ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message, argument", [
    (dict(pp=7), "pp=7 x virtual_stages=1 = 7 stages but the profile has 6 layers (each stage needs one): give pp x "
                 "virtual_stages <= 6", "pp"),
    (dict(pp=3, virtual_stages=3), "pp=3 x virtual_stages=3 = 9 stages but the profile has 6 layers (each stage "
                                   "needs one): give pp x virtual_stages <= 6", "pp"),
    (dict(pp="2"), "pp must be an integer >= 1, got '2'", "pp"),
    (dict(pp=2, num_microbatches=0), "num_microbatches must be an integer >= 1, got 0", "num_microbatches"),
    (dict(pp=2, dp=0), "dp must be an integer >= 1, got 0", "dp"),
    (dict(pp=2, virtual_stages=0), "virtual_stages must be an integer >= 1, got 0", "virtual_stages"),
    (dict(pp=2, balance=(3, 2, 1)), "balance=[3, 2, 1] must be pp x virtual_stages = 2 x 1 = 2 layer counts summing "
                                    "to the profile's 6 layers", "balance"),
    (dict(pp=2, recompute=(True,)), "recompute=[True] has 1 flags but there are 2 stages: give a bool or one per "
                                    "stage", "recompute"),
    (dict(pp=2, num_microbatches=3), "global_batch=16 is not divisible by dp x num_microbatches = 3",
     "global_batch"),
])
def test_predict_refuses_bad_sizes_first(kwargs, message, argument):
    err = refused(lambda: predict(profile6(), 16, "1f1b", **kwargs))
    assert str(err) == message and err.argument == argument


def test_predict_of_an_unknown_schedule_names_it():
    err = refused(lambda: predict(profile6(), 16, "nope", pp=2))
    assert "nope" in str(err) and err.argument == "schedule"


def test_predict_still_predicts():
    c = predict(profile6(), 16, "zbv", pp=3)
    assert (c.pp, c.virtual_stages, c.balance, c.layer_names) == (3, 2, (1,) * 6, ("Sequential",) * 6)


# ---- 4. Candidate JSON field types -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good():
    return plan(profile6(), 2, 1e9, 16, schedules=["1f1b"], top=1).best.to_json()


@pytest.mark.parametrize("field, value, what", [
    ("pp", "2", "an integer >= 1"),
    ("dp", 1.0, "an integer >= 1"),
    ("num_microbatches", 0, "an integer >= 1"),
    ("virtual_stages", True, "an integer >= 1"),
    ("microbatch_size", None, "an integer >= 1"),
    ("schedule", 3, "a schedule name (a string)"),
    ("split_backward", "no", "true or false"),
    ("step_time", "0.1", "a number >= 0"),
    ("bubble_fraction", -0.5, "a number >= 0"),
    ("balance", [6], "a list of pp x virtual_stages = 2 layer counts >= 1"),
    ("balance", ["3", "3"], "a list of pp x virtual_stages = 2 layer counts >= 1"),
    ("recompute", [0, 0], "a list of 2 true/false (one per stage)"),
    ("peak_memory", [1], "a list of pp = 2 byte counts >= 0"),
    ("layer_names", ["Sequential"] * 5, "a list of 6 layer class names (or empty: unknown)"),
])
def test_from_json_names_a_field_of_the_wrong_type(good, field, value, what):
    data = dict(good, **{field: value})
    err = refused(lambda: Candidate.from_json(data))
    shown = tuple(value) if isinstance(value, list) else value
    assert str(err) == f"candidate field {field!r} must be {what}, got {shown!r}"


def test_from_json_wants_lists_and_an_object(good):
    err = refused(lambda: Candidate.from_json(dict(good, balance="3,3")))
    assert str(err) == "candidate field 'balance' must be a list, got '3,3'"
    err = refused(lambda: Candidate.from_json([good]))
    assert str(err) == "a planned candidate is a JSON object (dict), got list"


# ---- 5. ties ---------------------------------------------------------------------------------------------------

def test_a_tie_reads_as_a_tie_and_names_what_differs():
    # 3 equal layers, no latency, on 2 ranks: zbv pp=1 with balance 1,2 or 2,1 takes the same time to float
    # rounding (the runner-up's last bits below the winner's); the winner has the smaller balance
    three = LayerProfile(forward=[1e-3] * 3, input_grad=[1e-3] * 3, weight_grad=[1e-3] * 3,
                         activation_bytes=[8 * MiB] * 3, output_bytes=[MiB] * 3, param_bytes=[4 * MiB] * 3,
                         microbatch_size=1)
    result = plan(three, 2, 1e12, 12, schedules=["zbv"], top=2)
    win, second = result[0], result[1]
    assert second.step_time == pytest.approx(win.step_time, rel=1e-12) and win.describe() == second.describe()
    # the winner holds the least memory of the ties (before: m=1 at 192 MiB won, as the search stopped on a bound
    # one ulp above the kept time before it simulated m=6 at 72 MiB)
    assert (win.num_microbatches, win.balance, max(win.peak_memory)) == (6, (1, 2), 72 * MiB)
    assert result.reason.endswith("; ties with zbv pp=1 dp=2 m=6 v=2 (balance 2,1 against the winner's 1,2; peak 80 "
                                  "MiB against the winner's 72 MiB)")
    assert "ahead" not in result.reason


def test_a_lead_is_a_percentage():
    result = plan(profile6(), 2, 1e9, 16, top=2)
    assert result.reason.endswith("; 1.0% ahead of zb-h2 pp=2 dp=1 m=8 v=1")


# ---- 6. argument -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, argument", [
    (dict(world_size=0), "world_size"),
    (dict(top=0), "top"),
    (dict(memory_per_rank=-1), "memory_per_rank"),
    (dict(memory_per_rank=1e3), "memory_per_rank"),  # PlanError
    (dict(schedules=["nope"]), "schedules"),
    (dict(schedules=[]), "schedules"),
    (dict(optimizer_states=-1), "optimizer_states"),
    (dict(global_batch=0), "global_batch"),
    (dict(max_microbatches=0), "max_microbatches"),
    (dict(virtual_stages=0), "virtual_stages"),
    (dict(num_layers=5), "num_layers"),
])
def test_every_bad_argument_is_named_in_argument(kwargs, argument):
    args = dict(profile=profile6(), world_size=2, memory_per_rank=1e9, global_batch=16)
    args.update(kwargs)
    err = refused(lambda: plan(**args))
    assert err.argument == argument
    assert isinstance(err, PlanError) == (kwargs.get("memory_per_rank") == 1e3)


# ---- 7. pipesched plan --json when nothing fits ----------------------------------------------------------------

def test_json_when_nothing_fits_is_json_and_exits_1(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile6().save(path)
    assert main(["plan", "--profile", str(path), "--world-size", "2", "--memory", "1e6", "--batch", "8",
                 "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    exc = refused(lambda: plan(profile6(), 2, 1e6, 8), PlanError)
    assert set(data) == {"error", "smallest_memory", "plan"}
    assert data["smallest_memory"] == int(-(-exc.smallest // 1))
    assert data["plan"] == exc.candidate.to_json() and all(data["plan"]["recompute"])
    assert data["error"].startswith("--memory=977 KiB: no configuration fits; the smallest memory per rank that fits")
    assert "error: --memory=977 KiB" in captured.err
