"""A rank that closes its Pipeline (or whose launch fn ends without closing it) while the other waits on it in a step:
the other raises a PipelineError saying that rank closed (ended), not that its process was lost (killed). Closing on
every rank after the last step raises nowhere. 2 forked gloo ranks of Linear(4, 4) per case; no timing assertion
(Pipeline timeout 60 s: a wait that only ended by the timeout would name the waiting rank itself, which the assertions
refuse)."""
import pytest

from pipesched.runtime import launch

import rt_close_peer

pytestmark = pytest.mark.multiprocess


def _leave(leaver: int, how: str) -> dict:
    """The other rank's report (the leaver's says it left)."""
    reports = launch(rt_close_peer.leave_while_other_steps, 2, leaver, how, timeout=120, start_method="fork")
    assert reports[leaver] == {"type": None, "left": "closed" if how == "close" else "returned"}
    return reports[1 - leaver]


@pytest.mark.parametrize("leaver", [1, 0], ids=["last-rank-closes", "store-host-closes"])
def test_a_peer_that_closed_its_pipeline_is_named_as_closed_not_killed(leaver):
    got = _leave(leaver, "close")
    other = 1 - leaver
    assert (got["type"], got["rank"], got["pp_rank"], got["lost"], got["ended"]) == (
        "PipelineError", leaver, leaver, False, "closed"), got
    assert got["message"].startswith(
        f"pipeline rank failure: world rank {leaver} (pipeline rank {leaver}) closed its Pipeline (pipe.close()) "
        f"while this rank still waited on it [reported to world rank {other}: while waiting for "), got
    assert "killed" not in got["message"] and "was lost" not in got["message"], got


@pytest.mark.parametrize("how", ["return", "return, kept"])
def test_a_peer_whose_launch_fn_returned_without_close_is_named_as_exited(how):
    # "return, kept": a global still held the Pipeline, so nothing announced it and its connections stayed open
    # until launch's grace ended the child: the other rank waited 20 s and named it lost (killed)
    got = _leave(1, how)
    assert (got["type"], got["rank"], got["pp_rank"], got["lost"], got["ended"]) == (
        "PipelineError", 1, 1, False, "exited"), got
    assert got["message"].startswith("pipeline rank failure: world rank 1 (pipeline rank 1) ended without closing its "
                                     "Pipeline (the Pipeline was dropped, or its process or launch fn ended) "
                                     "[reported to world rank 0: "), got


@pytest.mark.parametrize("steps", [1, 0], ids=["after-a-step", "before-any-step"])
def test_close_on_every_rank_after_the_last_step_raises_nowhere(steps):
    for rank, got in enumerate(launch(rt_close_peer.close_everywhere, 2, steps, timeout=120, start_method="fork")):
        assert (got["type"], got["closed"]) == (None, True), (rank, got)


def test_close_inside_a_running_step_is_refused_with_a_clear_error():
    reports = launch(rt_close_peer.close_inside_a_layer, 2, timeout=120, start_method="fork")
    for got in reports:
        assert got["type"] == "PipelineError" and got["rank"] == 1, got
        assert "close() was called while this Pipeline's step(), forward() or collective call is running" in \
            got["message"], got


def test_leave_unclosed_skips_a_pipeline_never_built_and_goes_on(monkeypatch):
    # a Pipeline(...) refused at construction (a misfit keyword) has no _closed; kept alive (say in a caught
    # exception's traceback) it stopped leave_unclosed before the live Pipelines after it (a hunt's finding)
    from pipesched.runtime import departure, pipeline_failure

    class NeverBuilt:
        pass

    class Live:
        _closed, _departure = False, None

    torn = []
    monkeypatch.setattr(pipeline_failure, "teardown", torn.append)
    live = Live()
    departure.leave_unclosed([NeverBuilt(), live])
    assert torn == [live] and live._closed
