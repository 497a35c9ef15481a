"""run_collective first meets the other pipeline ranks in a marked all-gather shaped like a step opening's row, so a
rank that opened its next step meanwhile ends every rank at once naming both calls (it waited for the timeout with
gloo's text; helper-70's failure trial, bug8); on every rank it returns what work returns. 2 forked gloo ranks."""
import pytest

from pipesched.runtime import launch

import rt_collective_meet as rt

pytestmark = pytest.mark.multiprocess


def test_run_collective_on_every_rank_returns_work_s_value():
    for got in launch(rt.case, 2, True, timeout=120, start_method="fork"):
        assert got == {"type": None, "got": 3.0, "again": 3.0}, got  # 1 + 2 over the pipeline group


def test_run_collective_against_a_step_ends_every_rank_naming_both_calls():
    for rank, got in enumerate(launch(rt.case, 2, False, timeout=120, start_method="fork")):
        assert (got["type"], got["origin"]) == ("PipelineError", rank), got
        assert ("the pipeline ranks made different collective calls: pipeline ranks [0] opened the next step (step() "
                "or forward()); pipeline ranks [1] are in run_collective(); every rank of a pipeline must make the "
                "same calls") in got["message"], got
