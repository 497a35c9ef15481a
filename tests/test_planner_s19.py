"""The planner's ties and arguments (session 19): the winner is the same for every ``top`` (one rounding rule for
step times in the search and the ranking), a tie goes to the simpler configuration (no split backward; one row per
program on one rank), ``predict`` checks ``recompute`` and ``split_backward`` as ``compile_program`` does, the
"nothing fits" message gives both byte counts, and ``from_plan``'s arguments of a zb-auto candidate compile the
plan's own program."""
import math

import pytest

import pipesched as ps
from pipesched.errors import ScheduleArgumentError
from pipesched.plan_result import Candidate, PlanError
from pipesched.plan_search import time_key
from pipesched.planner import format_bytes, pipeline_kwargs, predict
from pipesched.profile import LayerProfile
from pipesched.program_io import fingerprint

MiB = 2 ** 20
TOPS = (1, 5, 10000)


def staggered(n, weight_grad):
    """n layers, the forwards 1, 1.37, 1.74 ms in turn: one rank's step time is the same for every m (a few ulps)."""
    return LayerProfile(forward=[1e-3 * (1 + 0.37 * (i % 3)) for i in range(n)], input_grad=[1e-3] * n,
                        weight_grad=[weight_grad] * n, activation_bytes=[4 * MiB] * n, output_bytes=[MiB] * n,
                        param_bytes=[MiB] * n, microbatch_size=1)


def interleaved_tie():
    return LayerProfile(forward=(0.003, 0.003, 0.0001, 0.0001, 0.0032707905612273133, 0.003),
                        input_grad=(0.003, 0.0066304749841353304, 0.004920564281030281, 0.0001, 0.001, 0.001),
                        weight_grad=(0.0001, 0.003, 0.003, 0.0001, 0.0, 0.0001),
                        activation_bytes=(4194304, 1048576, 4194304, 1048576, 4194304, 4194304),
                        output_bytes=(1048576, 0, 1048576, 0, 4194304, 0),
                        param_bytes=(4203583, 63316965, 0, 0, 0, 39515684), microbatch_size=3, input_bytes=4242812,
                        latency=0.0001)


def split_tie():
    return LayerProfile(forward=(0.001, 0.003), input_grad=(0.003, 0.003), weight_grad=(0.0001, 0.0),
                        activation_bytes=(0, 4194304), output_bytes=(0, 0), param_bytes=(4194304, 1048576),
                        microbatch_size=1, input_bytes=2853572, bandwidth=1e8,
                        forward_fixed=(0.0007996519695885396, 0.001358534632571531),
                        input_grad_fixed=(0.0002729262681778498, 0.0010203227143530727),
                        weight_grad_fixed=(2.9327078111999252e-05, 0.0))


def zb_auto_profile():
    f = [1e-3, 4e-3, 1e-3, 1e-3]
    return LayerProfile(forward=f, input_grad=f, weight_grad=f, activation_bytes=[8 * MiB] * 4, output_bytes=[MiB] * 4,
                        param_bytes=[MiB, MiB, 20 * MiB, 20 * MiB], microbatch_size=1, layer_names=["Linear"] * 4)


def winner(c: Candidate) -> tuple:
    return c.schedule, c.pp, c.dp, c.num_microbatches, c.virtual_stages, c.balance, c.split_backward, max(c.peak_memory)


# ---- 1. the winner does not depend on top ---------------------------------------------------------------------

@pytest.mark.parametrize("top", TOPS)
def test_equal_times_the_least_memory_wins_whatever_top(top):
    # one rank, every m within an ulp of 0.11376 s: the largest m searched (8) holds the least memory
    best = ps.plan(staggered(3, 0.0), 1, 2 ** 40, 16, schedules=["1f1b"], top=top).best
    assert winner(best) == ("1f1b", 1, 1, 8, 1, (3,), False, 36 * MiB)
    assert time_key(best.step_time) == 0.11376


@pytest.mark.parametrize("top", TOPS)
def test_equal_times_with_the_default_schedules_whatever_top(top):
    best = ps.plan(staggered(5, 1e-3), 1, 2 ** 40, 12, top=top).best  # top=5 gave m=4, 80 MiB
    assert winner(best) == ("1f1b", 1, 1, 6, 1, (5,), False, 60 * MiB)
    assert time_key(best.step_time) == 0.19776


@pytest.mark.parametrize("top", TOPS)
def test_equal_time_and_memory_fewer_stages_win_whatever_top(top):
    result = ps.plan(interleaved_tie(), 4, 1057616448.0, 8, schedules=["interleaved-1f1b", "zbv"],
                     optimizer_states=0.0, top=top)
    assert winner(result.best) == ("interleaved-1f1b", 1, 4, 2, 2, (2, 4), False, 220363920)  # top=1 gave v=4
    assert time_key(result.best.step_time) == time_key(0.02371455321759528)


def test_a_bound_within_float_slack_of_the_kept_time_goes_on():
    from pipesched.plan_search import ranks_after
    t = 0.11375999999999999
    assert not ranks_after(0.11376000000000003, t)  # a tie to 9 digits: simulate it
    assert not ranks_after(t * (1 + 1e-15), t)
    assert ranks_after(0.113761, t)


# ---- 2. a tie goes to the simpler configuration; one row per program on one rank -------------------------------

@pytest.mark.parametrize("top", TOPS)
def test_a_split_that_changes_nothing_loses_to_no_split(top):
    result = ps.plan(split_tie(), 2, 2 ** 50, 8, schedules=["1f1b"], top=top)
    assert winner(result.best) == ("1f1b", 2, 1, 4, 1, (1, 1), False, 16 * MiB)
    same = predict(split_tie(), 8, "1f1b", pp=2, num_microbatches=4, balance=(1, 1), split_backward=True)
    assert time_key(same.step_time) == time_key(result.best.step_time)  # the split one ties: still not the winner
    assert max(same.peak_memory) == max(result.best.peak_memory)
    assert not any(c.split_backward and c.num_microbatches == 4 for c in result)  # one row, the simpler
    assert "split backward" not in result.reason.split(":")[0]


def test_one_rank_lists_each_program_once():
    result = ps.plan(staggered(5, 1e-3), 1, 2 ** 40, 12, top=10000)
    rows = [(c.pp, c.dp, c.num_microbatches, c.balance, c.recompute, time_key(c.step_time), c.peak_memory)
            for c in result]
    assert len(rows) == len(set(rows))
    m4 = [c.schedule for c in result if c.num_microbatches == 4]
    assert "1f1b" in m4 and "zb-h1" not in m4  # zb-h1 on one rank is 1f1b's program: the first by name stays


def test_a_tie_in_the_reason_is_a_tie_as_ranked():
    result = ps.plan(staggered(5, 1e-3), 1, 2 ** 40, 12, top=3)
    assert result.reason.endswith("; ties with 1f1b pp=1 dp=1 m=4 v=1 (peak 80 MiB against the winner's 60 MiB)")


# ---- 3. predict refuses what compile_program refuses ----------------------------------------------------------

@pytest.mark.parametrize("kwargs, message, argument", [
    (dict(recompute=["no", "no"]), "recompute must hold only True or False (one per stage), got 'no' in ['no', 'no']",
     "recompute"),
    (dict(recompute=[0, 1]), "recompute must hold only True or False (one per stage), got 0 in [0, 1]", "recompute"),
    (dict(recompute=1), "recompute must be True, False or a list of one bool per stage, got 1", "recompute"),
    (dict(recompute="no"), "recompute must be True, False or a list of one bool per stage, got 'no'", "recompute"),
    (dict(recompute=None), "recompute must be True, False or a list of one bool per stage, got None", "recompute"),
    (dict(split_backward="no"), "split_backward must be True or False, got str 'no'", "split_backward"),
    (dict(split_backward=None), "split_backward must be True or False, got NoneType None", "split_backward"),
])
def test_predict_refuses_what_is_not_a_bool(kwargs, message, argument):
    p = staggered(4, 1e-3)
    with pytest.raises(ScheduleArgumentError) as info:
        predict(p, 8, "1f1b", pp=2, **kwargs)
    assert str(info.value) == message and info.value.argument == argument
    with pytest.raises(ValueError) as compiled:  # compile_program's own words for recompute
        ps.compile_program("1f1b", 2, 8, **kwargs)
    assert argument == "split_backward" or str(compiled.value) == message


def test_predict_takes_bools():
    p = staggered(4, 1e-3)
    assert predict(p, 8, "1f1b", pp=2, recompute=[False, True]).recompute == (False, True)
    assert predict(p, 8, "1f1b", pp=2, recompute=True, split_backward=True).split_backward is True


# ---- 4. nothing fits: both byte counts ------------------------------------------------------------------------

def test_nothing_fits_gives_the_bytes_of_both():
    p = staggered(4, 1e-3)
    with pytest.raises(PlanError) as first:
        ps.plan(p, 2, 1e6, 8)
    need = int(math.ceil(first.value.smallest))
    with pytest.raises(PlanError) as info:
        ps.plan(p, 2, need - 1, 8)  # one byte short: both read the same rounded
    err = info.value
    assert format_bytes(need - 1) == format_bytes(need)
    assert str(err) == (f"memory_per_rank={format_bytes(need)}: no configuration fits; the smallest memory per rank "
                        f"that fits is {format_bytes(need)} ({need} bytes) against {need - 1} bytes given, with "
                        f"{err.candidate.describe()} (every stage recomputed)")
    with pytest.raises(PlanError, match=r"\(\d+ bytes\) against 1000000.5 bytes given"):
        ps.plan(p, 2, 1e6 + 0.5, 8)


# ---- 5. from_plan of zb-auto compiles the plan's program ------------------------------------------------------

def plans_program(profile, c: Candidate):
    """zb-auto compiled as the plan simulated it: the profile scaled to the microbatch, the default limit."""
    return ps.compile_program("zb-auto", c.pp, c.num_microbatches, dp_size=c.dp,
                              recompute=list(c.recompute) if any(c.recompute) else False,
                              split_backward=c.split_backward, costs=profile.scaled(c.microbatch_size).costs(c.balance))


def pipelines_program(kwargs: dict, pp: int):
    """What ``Pipeline(**kwargs)`` compiles on ``pp`` pipeline ranks (runtime.construction's program_for)."""
    return ps.compile_program(kwargs["schedule"], pp, kwargs["num_microbatches"], kwargs["virtual_stages"],
                              dp_size=kwargs["dp_size"], recompute=kwargs["recompute"],
                              split_backward=kwargs["split_backward"], costs=kwargs["costs"],
                              memory_limit=kwargs["memory_limit"])


def test_from_plan_of_zb_auto_compiles_the_plans_program():
    profile, budget = zb_auto_profile(), 180 * MiB
    c = ps.plan(profile, 2, budget, 8, schedules=["zb-auto"], top=3).best
    assert winner(c) == ("zb-auto", 2, 1, 8, 1, (2, 2), False, 176 * MiB)
    kwargs = pipeline_kwargs(c, 4, 2, ["Linear"] * 4, {"timeout": 60})
    assert kwargs["costs"] == profile.scaled(c.microbatch_size).costs(c.balance)
    assert kwargs["memory_limit"] == [min(2, c.num_microbatches)] * 2 and kwargs["timeout"] == 60
    program = pipelines_program(kwargs, c.pp)
    assert fingerprint(program) == fingerprint(plans_program(profile, c))
    timeline = ps.simulate(program, kwargs["costs"])
    assert timeline.makespan == c.step_time and max(c.peak_memory) <= budget


@pytest.mark.parametrize("recompute", [False, [True, False]])
def test_predicted_zb_auto_candidate_carries_its_costs(recompute):
    profile = zb_auto_profile()
    c = predict(profile, 8, "zb-auto", pp=2, num_microbatches=4, recompute=recompute)
    kwargs = pipeline_kwargs(c, 4, 2, None, None)
    assert kwargs["recompute"] == recompute and kwargs["memory_limit"] == [2, 2]
    program = pipelines_program(kwargs, 2)
    assert fingerprint(program) == fingerprint(plans_program(profile, c))
    assert ps.simulate(program, kwargs["costs"]).makespan == c.step_time


def test_zb_auto_from_json_keeps_the_costs_and_the_limit():
    c = ps.plan(zb_auto_profile(), 2, 180 * MiB, 8, schedules=["zb-auto"], top=1).best
    back = Candidate.from_json(c.to_json())
    assert back == c and back.costs == c.costs  # the costs are in the JSON form
    kwargs = pipeline_kwargs(back, 4, 2)
    assert kwargs["costs"] == c.costs and kwargs["memory_limit"] == [2, 2]


def test_other_schedules_get_neither_costs_nor_limit():
    c = predict(zb_auto_profile(), 8, "1f1b", pp=2, num_microbatches=4)
    assert c.costs is not None
    kwargs = pipeline_kwargs(c, 4, 2)
    assert "costs" not in kwargs and "memory_limit" not in kwargs
