"""Pipeline.from_plan's refusal of an argument the plan decides names it and its planned value shortly: a zb-auto
plan's costs are a CostModel whose repr runs to hundreds of characters, so the message points at candidate.costs."""
import pytest

import pipesched as ps
from pipesched.planner import pipeline_kwargs, predict

from test_planner_s19 import zb_auto_profile


def test_a_given_costs_for_a_zb_auto_plan_is_refused_pointing_at_the_candidates_costs():
    c = predict(zb_auto_profile(), 8, "zb-auto", pp=2, num_microbatches=4)
    with pytest.raises(ValueError) as info:
        pipeline_kwargs(c, 4, 2, None, {"costs": ps.CostModel()})
    assert str(info.value) == ("Pipeline.from_plan: costs is decided by the plan (costs=the CostModel the plan "
                               "simulated it with: candidate.costs); leave it out, or build Pipeline(...) yourself")


def test_other_decided_arguments_show_their_planned_value():
    c = predict(zb_auto_profile(), 8, "zb-auto", pp=2, num_microbatches=4)
    with pytest.raises(ValueError) as info:
        pipeline_kwargs(c, 4, 2, None, {"memory_limit": 3, "costs": ps.CostModel()})
    assert str(info.value) == ("Pipeline.from_plan: costs, memory_limit are decided by the plan (costs=the CostModel "
                               "the plan simulated it with: candidate.costs); leave it out, or build Pipeline(...) "
                               "yourself")
    with pytest.raises(ValueError) as info:
        pipeline_kwargs(c, 4, 2, None, {"memory_limit": 3})
    assert str(info.value) == ("Pipeline.from_plan: memory_limit is decided by the plan (memory_limit=[2, 2]); leave "
                               "it out, or build Pipeline(...) yourself")
