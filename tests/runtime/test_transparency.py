"""Gradients and losses of the pipeline equal the unsplit model's over the same microbatches."""
import pytest

from rt_cases import SCHEDULES

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_two_ranks_bitwise_over_three_optimizer_steps(two_ranks, schedule):
    for rank, results in enumerate(two_ranks):
        case = results[("transparency", schedule)]
        assert [s["grads"] for s in case["steps"]] == [8, 8, 8]  # 8 layers x (weight, bias) / 2 ranks
        assert [s["bitwise"] for s in case["steps"]] == [True, True, True], (rank, case)
        assert [s["loss_equal"] for s in case["steps"]] == [True, True, True], (rank, case)
        assert case["params_equal"] is True
        assert case["events"] == case["stream"]  # one measured event per instruction


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_four_ranks_bitwise(four_ranks, schedule):
    for rank, results in enumerate(four_ranks):
        case = results[("transparency", schedule)]
        assert [s["grads"] for s in case["steps"]] == [4, 4]
        assert [s["bitwise"] for s in case["steps"]] == [True, True], (rank, case)
        assert [s["loss_equal"] for s in case["steps"]] == [True, True]
        assert case["params_equal"] is True


def test_four_ranks_fewer_microbatches_than_ranks_1f1b(four_ranks):
    for results in four_ranks:
        case = results["m<p"]
        assert [s["bitwise"] and s["loss_equal"] for s in case["steps"]] == [True, True]


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_dp2_x_pp2_grads_are_the_mean_of_the_shards(four_ranks, schedule):
    layout = []
    for rank, results in enumerate(four_ranks):
        case = results[("dp", schedule)]
        layout.append((case["dp_rank"], case["pp_rank"]))
        assert case["grads"] == 8
        assert case["worst"] <= 1e-6, (rank, case)
        assert case["loss_equal"] is True  # each replica returns its own shard's loss, exactly
    assert layout == [(0, 0), (0, 1), (1, 0), (1, 1)]  # world rank g = replica g // 2, pipeline rank g % 2


def test_uneven_microbatches_batch_10_into_4(two_ranks):
    for results in two_ranks:
        step = results["uneven"]["steps"][0]
        assert (step["bitwise"], step["loss_equal"], step["grads"]) == (True, True, 8)


def test_tuple_of_float_int64_bool_through_four_stages(two_ranks):
    assert [r["tuple"]["stages"] for r in two_ranks] == [(0, 2), (1, 3)]
    for results in two_ranks:
        assert results["tuple"] == {**results["tuple"], "bitwise": True, "loss_equal": True}
    # balance [2, 1, 1, 1]: rank 0 holds Mix, Mix | Mix (3 tensors each), rank 1 Mix | Head (2 tensors)
    assert [r["tuple"]["grads"] for r in two_ranks] == [9, 5]


def test_gradients_accumulate_across_steps_like_plain_pytorch(two_ranks):
    assert [r["accumulate"][:2] for r in two_ranks] == [(8, True), (8, True)]


def test_split_backward_input_then_weight_gradients_bitwise(two_ranks):
    rank_ops = [["F", "I", "SEND_F", "RECV_B", "W"], ["F", "I", "RECV_F", "SEND_B", "W"]]
    for results, ops in zip(two_ranks, rank_ops):
        assert results["split"] == {"loss_equal": True, "grads": (8, True), "ops": sorted(ops)}
