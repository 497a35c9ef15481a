"""GradScaler agreement over every rank of a DP=2 x PP=2 job (4 spawned gloo ranks) against the unsplit model."""
import pytest
import torch

from pipesched.runtime import launch

import rt_amp

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results():
    return launch(rt_amp.dp_suite, 4, timeout=300)


def test_an_inf_on_one_rank_of_one_replica_makes_all_four_ranks_skip(results):
    # step 2: world rank 3 (pipeline rank 1 of replica 1) alone holds an inf gradient, written after the
    # data-parallel all-reduce. Agreeing over the pipeline group only would leave ranks 0 and 1 stepping, over the
    # data-parallel group only ranks 0 and 2: all four skip, halve the scale and stay equal to the reference
    for rank, res in enumerate(results):
        case = res["dp"]
        assert case["layout"] == (rank % 2, rank // 2)
        steps = case["steps"]
        assert [s["overflow_here"] for s in steps] == [False, rank == 3, False], (rank, steps)
        assert [s["skipped"] for s in steps] == [False, True, False], (rank, steps)
        assert [s["scale"] for s in steps] == [s["ref_scale"] for s in steps] == [1024.0, 512.0, 512.0]
        # replicas average their halves of the batch: the unsplit model's gradient to rounding (README: 1e-6)
        assert max(s["weights_rel"] for s in steps) <= 1e-6, (rank, steps)


def test_the_replicas_stay_bitwise_equal(results):
    for a, b in ((0, 2), (1, 3)):
        mine, theirs = results[a]["dp"]["weights"], results[b]["dp"]["weights"]
        assert len(mine) == len(theirs) == 4 and all(torch.equal(x, y) for x, y in zip(mine, theirs))
