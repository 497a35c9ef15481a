"""zb-h1 and zb-h2 on 4 ranks (PP 4, then DP 2 x PP 2) against the unsplit model: losses equal, gradients and
parameters bitwise after AdamW steps; with recompute (R before I) and uneven microbatches."""
import pytest

from pipesched.runtime import launch

import rt_zero_bubble

SCHEDULES = rt_zero_bubble.SCHEDULES
check_pipeline_case = rt_zero_bubble.check_pipeline_case


@pytest.fixture(scope="module")
def results():
    return launch(rt_zero_bubble.four_rank_suite, 4, timeout=400)


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_four_ranks_bitwise(results, schedule, recompute, m):
    key = ("recompute",) if recompute else ()
    for res in results:
        check_pipeline_case(res["pipeline"][(schedule, key, m)], recompute)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_four_ranks_program_order(results, schedule):
    for res in results:
        check_pipeline_case(res["pipeline"][(schedule, "program-order", 8)], False)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dp2_pp2(results, schedule, recompute):
    """Gradients = the mean of the two shards' unsplit gradients, bitwise (two summands: (a + b) / 2 is exact
    whichever order the all-reduce adds them in); each replica's loss bitwise its shard's."""
    seen = set()
    for res in results:
        case = res["dp"][(schedule, recompute)]
        assert case["loss_equal"] is True and case["grads"] == 8 and case["worst"] == 0.0, case
        seen.add((case["pp_rank"], case["dp_rank"]))
    assert seen == {(0, 0), (1, 0), (0, 1), (1, 1)}
