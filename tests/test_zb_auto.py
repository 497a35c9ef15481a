"""zb-auto: the schedule built from a CostModel and a memory limit (pipesched/schedules/zb_auto.py)."""
import json

import pytest
from hypothesis import given, settings, strategies as st

import pipesched as ps
from pipesched import CostModel, ScheduleArgumentError
from pipesched.cli import main
from pipesched.lower import add_send_recv
from pipesched.schedules.zb_auto import WARMUPS, check_memory_limit, default_memory_limit, greedy_streams, warmup
from pipesched.timeline import peak_inflight


def _costs(draw, p):
    per = st.lists(st.floats(0.1, 10), min_size=p, max_size=p)
    fwd, i, w = draw(per), draw(per), draw(per)
    return CostModel(forward=fwd, backward=[a + b for a, b in zip(i, w)], input_grad=i, weight_grad=w,
                     latency=draw(st.floats(0, 2)), bandwidth=draw(st.floats(1e3, 1e9)),
                     activation_bytes=draw(st.lists(st.floats(0, 1e6), min_size=p, max_size=p)))


@st.composite
def cases(draw):
    p, m = draw(st.integers(1, 8)), draw(st.integers(1, 32))
    limit = draw(st.one_of(st.none(), st.integers(1, 2 * p), st.lists(st.integers(1, 2 * p), min_size=p,
                                                                          max_size=p)))
    return p, m, _costs(draw, p), limit


@settings(max_examples=60, deadline=None)
@given(cases())
def test_valid_within_its_limit_and_never_slower_than_zb_h1(case):
    p, m, costs, limit = case
    program = ps.compile_program("zb-auto", p, m, costs=costs, memory_limit=limit)  # validates
    timeline = ps.simulate(program, costs)
    cap = default_memory_limit(p, m) if limit is None else (limit,) * p if isinstance(limit, int) else tuple(limit)
    assert all(peak <= c for peak, c in zip(timeline.peak_inflight, cap)), (timeline.peak_inflight, cap)
    h1 = ps.compile_program("zb-h1", p, m)
    if all(peak <= c for peak, c in zip(peak_inflight(h1.ranks), cap)):  # always for the default limit
        assert timeline.makespan <= ps.simulate(h1, costs).makespan
    assert program.meta["zb_auto"]["makespans"][program.meta["zb_auto"]["chosen"]] == timeline.makespan


@settings(max_examples=30, deadline=None)
@given(cases())
def test_every_greedy_candidate_alone_validates_and_keeps_the_limit(case):
    p, m, costs, limit = case
    cap = check_memory_limit(limit, p, m)
    times = {"F": costs.per_stage("forward", p), "I": costs.per_stage("input_grad", p),
             "W": costs.per_stage("weight_grad", p),
             "msg": tuple(costs.message_seconds(b) for b in costs.per_stage("activation_bytes", p))}
    for a, b in WARMUPS:
        for mode in (("alternate", "fill"), ("i-first", "fit")):
            streams = greedy_streams(p, m, cap, times, mode, warmup(p, a, b))
            program = ps.schedules._common.program("zb-auto", streams, tuple(range(p)), m)
            ps.validate(add_send_recv(program))
            assert all(x <= c for x, c in zip(peak_inflight(program.ranks), cap))
            assert sorted(map(str, (i for s in streams for i in s))) == sorted(
                map(str, (i for s in ps.build("zb-h1", p, m).ranks for i in s)))  # every F, I, W once


def test_default_limit_is_zb_h1s_peak():
    for p, m in ((1, 1), (4, 2), (4, 8), (8, 32)):
        assert default_memory_limit(p, m) == (min(p, m),) * p == ps.simulate(ps.compile_program("zb-h1", p, m)
                                                                             ).peak_inflight
        program = ps.compile_program("zb-auto", p, m)
        assert program.meta["zb_auto"]["memory_limit"] == [min(p, m)] * p


def test_uniform_costs_match_zb_h1_closed_form():
    # F = I = W = 1 s, free messages: (3m + p - 1) s, ZB-H1's optimum at its memory
    assert ps.simulate(ps.compile_program("zb-auto", 4, 8), CostModel()).makespan == 27.0
    assert ps.compile_program("zb-auto", 4, 8).meta["zb_auto"]["chosen"].startswith("greedy-alternate")


#: the README's table: p=4, m=8; makespans (s) of 1f1b, zb-h1, zb-h2, zb-auto (limit 4 = default), zb-auto (limit 7)
ADAPTS = [
    (CostModel(forward=1, backward=4, input_grad=1, weight_grad=3, latency=0.5), (63.0, 47.5, 49.5, 46.0, 44.5)),
    (CostModel(forward=1, latency=1.0), (49.0, 41.0, 33.0, 39.0, 30.0)),
    (CostModel(forward=[1, 2, 1, 1], backward=[2, 4, 2, 2], latency=0.5), (56.0, 51.5, 49.5, 49.5, 49.5)),
]


@pytest.mark.parametrize("costs, expected", ADAPTS, ids=["W-expensive", "high-latency", "uneven-stages"])
def test_adapts_to_the_costs(costs, expected):
    got = tuple(ps.simulate(ps.compile_program(s, 4, 8), costs).makespan for s in ("1f1b", "zb-h1", "zb-h2"))
    got += tuple(ps.simulate(ps.compile_program("zb-auto", 4, 8, costs=costs, memory_limit=lim), costs).makespan
                 for lim in (None, 7))
    assert got == expected


@pytest.mark.parametrize("limit, message", [
    (0, "memory_limit must be an integer >= 1, got 0"),
    (True, "memory_limit must be an integer >= 1, got True"),
    ("4", "memory_limit must be an integer >= 1, got '4'"),
    ([4, 4], r"memory_limit=\[4, 4\]: a per-rank limit needs one integer >= 1 per rank \(4\), got 2"),
    ([4, 4, 0, 4], "memory_limit must be an integer >= 1, got 0"),
])
def test_bad_memory_limit_is_named(limit, message):
    with pytest.raises(ScheduleArgumentError, match=message) as info:
        ps.compile_program("zb-auto", 4, 8, memory_limit=limit)
    assert info.value.argument == "memory_limit"


def test_costs_only_for_schedules_built_from_costs():
    with pytest.raises(ScheduleArgumentError, match="schedule '1f1b' does not take costs") as info:
        ps.compile_program("1f1b", 2, 2, costs=CostModel())
    assert info.value.argument == "costs"
    with pytest.raises(ScheduleArgumentError, match="schedule 'zb-h1' does not take memory_limit"):
        ps.compile_program("zb-h1", 2, 2, memory_limit=2)
    with pytest.raises(ScheduleArgumentError, match="virtual_stages must be 1"):
        ps.compile_program("zb-auto", 2, 2, 2)
    with pytest.raises(ps.CostError, match="cost forward has 2 values but the program has 4 stages"):
        ps.compile_program("zb-auto", 4, 8, costs=CostModel(forward=[1, 2]))


def test_cli_builds_for_the_cost_options(capsys):
    assert main(["simulate", "zb-auto", "-p", "4", "-m", "8", "--latency", "1", "--memory-limit", "7",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] == 30.0 and max(out["peak_inflight"]) <= 7
    assert main(["simulate", "zb-auto", "-p", "4", "-m", "8", "--memory-limit", "4,4"]) == 2
    assert "--memory-limit 4,4: memory_limit=[4, 4]: a per-rank limit needs" in capsys.readouterr().err
    assert main(["simulate", "zb-h1", "-p", "4", "-m", "8", "--memory-limit", "4"]) == 2
    assert "--memory-limit 4: memory_limit=4: schedule 'zb-h1' does not take memory_limit" in capsys.readouterr().err
    assert main(["simulate", "zb-auto", "-p", "4", "-m", "8", "--forward", "1,2"]) == 2
    assert "--forward: cost forward has 2 values" in capsys.readouterr().err


def test_pipeline_program_choice_passes_costs_to_zb_auto_only():
    from pipesched.user_programs import program_for

    costs = CostModel(forward=1.0, backward=1.5, input_grad=1.0, weight_grad=0.5, latency=1.0)
    got = program_for("zb-auto", 2, 4, None, 1, costs=costs, memory_limit=3)  # what Pipeline(...) compiles
    assert got == ps.compile_program("zb-auto", 2, 4, costs=costs, memory_limit=3)
    assert got.meta["zb_auto"]["chosen"] == "greedy-alternate-fill-w1x+1"
    with pytest.raises(ValueError, match="costs=CostModel.* a given Program is run as it is: drop costs"):
        program_for(ps.compile_program("zb-h1", 2, 4), 2, 4, None, 1, costs=costs)


def test_costs_that_are_not_a_cost_model_name_the_argument():
    from pipesched import ScheduleArgumentError, compile_program

    with pytest.raises(ScheduleArgumentError, match=r"^costs must be a pipesched.CostModel \(seconds, bytes per "
                                                    r"stage\), got str 'x'$") as info:
        compile_program("zb-auto", 2, 2, costs="x")
    assert info.value.argument == "costs"
