"""A rank that stalls (alive, connections open, no error) past the timeout is named by the ranks that timed out
waiting for it (runtime/stalled.py): they answer a roll call in the store and name the ranks that did not. Forked
gloo ranks, Pipeline timeout 3 s, the stalled rank pauses 7 s; no timing assertion."""
import pytest

from pipesched.runtime import launch

import rt_stalled

pytestmark = pytest.mark.multiprocess


def _note(rank: int, pp: int) -> str:
    return (f"world rank {rank} (pipeline rank {pp}) did not time out within 1 s of this rank and kept their "
            f"connections open")


@pytest.mark.parametrize("stalled", [1, 0], ids=["last-rank-stalls", "first-rank-stalls"])
def test_two_ranks_name_the_one_that_stalled(stalled):
    reports = launch(rt_stalled.pause_between_steps, 2, stalled, 7.0, timeout=120, start_method="fork")
    waiter = 1 - stalled
    for got in reports:  # the waiter's own timeout, with the note; the stalled rank reads the same record later
        assert got["type"] == "PipelineError", got
        assert got["rank"] == waiter, got
        assert got["stalled"] == (stalled,), got  # the stall, by world rank, for code that acts on it
        assert _note(stalled, stalled) in got["message"], got
        assert f"world rank {waiter} (pipeline rank {waiter}) did not" not in got["message"], got


def test_three_ranks_name_only_the_stalled_one():
    reports = launch(rt_stalled.pause_between_steps, 3, 2, 7.0, timeout=120, start_method="fork")
    for got in reports:
        assert got["type"] == "PipelineError", got
        assert _note(2, 2) in got["message"], got
        assert got["stalled"] == (2,), got
        assert "world rank 0 (pipeline rank 0) did not" not in got["message"], got
        assert "world rank 1 (pipeline rank 1) did not" not in got["message"], got
