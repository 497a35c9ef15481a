"""zb-h1 and zb-h2 on 2 ranks against the unsplit model: losses equal, gradients and parameters bitwise after
AdamW steps; with recompute (R before I), uneven microbatches and program order."""
import pytest

from pipesched.runtime import launch

import rt_zero_bubble

SCHEDULES = rt_zero_bubble.SCHEDULES
check_pipeline_case = rt_zero_bubble.check_pipeline_case


@pytest.fixture(scope="module")
def results():
    return launch(rt_zero_bubble.pipeline_suite, 2, timeout=300)


@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_bitwise(results, schedule, recompute, m):
    key = ("recompute",) if recompute else ()
    for res in results:
        check_pipeline_case(res[(schedule, key, m)], recompute)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_program_order(results, schedule):
    for res in results:
        check_pipeline_case(res[(schedule, "program-order", 8)], False)
