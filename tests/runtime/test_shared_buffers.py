"""A module reused at two places of the model with its uses on two pipeline ranks: each rank would update only its own
copy of the module's buffers (nothing sums buffers), silently unlike the unsplit model. A norm layer tracking running
statistics is refused at construction; any other buffer that changes during a step ends every rank naming it; a
buffer that never changes (a shared table), or uses on one rank, run as before (helper-68's trial, bug9).
2 forked gloo ranks, 6 layers cut 3 + 3 (uses at layers 1 and 4 on ranks 0 and 1) or 5 + 1 (both on rank 0)."""
import pytest

from pipesched.runtime import launch

import rt_shared_buffers as rt

pytestmark = pytest.mark.multiprocess


def _run(kind, balance):
    return launch(rt.case, 2, kind, balance, timeout=120, start_method="fork")


def test_a_batchnorm_on_two_ranks_is_refused_at_construction_on_every_rank():
    for got in _run("batchnorm", [3, 3]):
        assert got == {"type": "ValueError", "message": (
            "buffer '1.running_mean' = '4.running_mean' is used by stages [0, 1] on pipeline ranks [0, 1]: "
            "BatchNorm1d updates it in every training forward, and each rank would update only its own copy "
            "(buffers are not summed like tied parameters), so its running statistics would differ from the "
            "unsplit model's; put its uses in one stage (balance=), or give each use its own module")}, got


def test_a_batchnorm_in_two_stages_of_one_rank_is_refused_too():
    """zbv on 2 ranks: stages 0 and 3 on rank 0 (layers 0-1 and 4-5 with balance [2, 1, 1, 2]): the EMA updates
    would run all microbatches through stage 0, then stage 3, not in the unsplit model's order (helper-77, bug2)."""
    for got in launch(rt.case, 2, "batchnorm", [2, 1, 1, 2], "zbv", timeout=120, start_method="fork"):
        assert got == {"type": "ValueError", "message": (
            "buffer '1.running_mean' = '4.running_mean' is used by stages [0, 3] on pipeline ranks [0]: "
            "BatchNorm1d updates it in every training forward, and its stages would update it in another order "
            "than the unsplit model (a rank runs one stage's microbatches before the next stage's), so its running "
            "statistics would differ from the unsplit model's; put its uses in one stage (balance=), or give each "
            "use its own module")}, got


def test_a_buffer_changed_on_two_ranks_ends_every_rank_naming_it():
    for rank, got in enumerate(_run("counter", [3, 3])):
        assert (got["type"], got["origin"]) == ("PipelineError", rank), got  # each rank's own check failed
        assert ("buffer '1.calls' = '4.calls' is used by stages [0, 1] on pipeline ranks [0, 1], and this rank's "
                "forward changed it") in got["message"], got


def test_a_shared_buffer_that_never_changes_trains_as_the_unsplit_model():
    for got in _run("table", [3, 3]):
        assert got["type"] is None and got["losses"] == got["expected"], got
        assert len(got["losses"]) == 2 and got["losses"][0] > 0, got


def test_uses_on_one_rank_are_not_refused():
    for got in _run("batchnorm", [5, 1]):
        assert got["type"] is None and got["losses"] == got["expected"], got
        assert len(got["losses"]) == 2 and got["losses"][0] > 0, got
