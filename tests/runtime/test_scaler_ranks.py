"""A GradScaler passed to pipe.step on one pipeline rank only, or with other settings on one rank: the ValueError,
on every rank, names which pipeline ranks passed it (in how many steps) and which did not, or which rank has which
setting. 2 spawned gloo ranks; and the naming of world ranks with data parallelism."""
import pytest

from pipesched.runtime import launch
from pipesched.runtime.scaler_vote import _by_value, _steps
from pipesched.runtime.comm import Grid

import rt_scaler_ranks


@pytest.fixture(scope="module")
def results():
    return launch(rt_scaler_ranks.suite, 2, timeout=240)


@pytest.mark.multiprocess
def test_a_scaler_on_one_rank_only_names_both_ranks(results):
    for res in results:  # the same message on both ranks
        assert res["last only"] == (
            "scaler: the ranks passed this GradScaler to pipe.step(..., scaler=...) in different numbers of steps: "
            "in no step (scaler=None) on pipeline rank 0, in 1 step on pipeline rank 1; pass it to pipe.step on "
            "every rank in every step")
        assert res["first only"] == (
            "scaler: the ranks passed this GradScaler to pipe.step(..., scaler=...) in different numbers of steps: "
            "in 1 step on pipeline rank 0, in no step (scaler=None) on pipeline rank 1; pass it to pipe.step on "
            "every rank in every step")


@pytest.mark.multiprocess
def test_scalers_with_other_settings_name_each_ranks_value(results):
    for res in results:
        assert res["init_scale"] == (
            "scaler: the ranks' GradScalers differ in scale: 1024 on pipeline rank 0, 2048 on pipeline rank 1; "
            "build it with the same arguments on every rank and call its update() on every rank after each step")
        assert res["growth_interval"] == (
            "scaler: the ranks' GradScalers differ in growth_interval: 2000 on pipeline rank 0, 10 on pipeline "
            "rank 1; build it with the same arguments on every rank")
        assert res["alike"] == "no error"


def test_with_data_parallelism_each_rank_is_named_by_replica_and_world_rank():
    grid = Grid(world_rank=0, world_size=4, pp_size=2, dp_size=2)
    assert _by_value([3, 3, 3, 0], grid, _steps) == (
        "in 3 steps on pipeline rank 0 of replica 0 (world rank 0), pipeline rank 1 of replica 0 (world rank 1), "
        "pipeline rank 0 of replica 1 (world rank 2), in no step (scaler=None) on pipeline rank 1 of replica 1 "
        "(world rank 3)")
    assert _by_value([1, 0, 1], Grid(0, 3, 3, 1), _steps) == (
        "in 1 step on pipeline ranks 0, 2, in no step (scaler=None) on pipeline rank 1")
