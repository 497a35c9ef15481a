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


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_split_backward_is_bitwise_and_runs_i_then_w_on_ranks_that_send_gradients(two_ranks, schedule):
    # split_backward=True splits the stages whose input gradient goes to another rank: with p=2 every
    # stage but 0, so rank 0 keeps B for stage 0 unless it also holds a later stage (interleaved)
    ops = {0: ["B", "F", "RECV_B", "SEND_F"] + (["I", "RECV_F", "SEND_B", "W"] if schedule != "gpipe" and
                                                 schedule != "1f1b" else []),
           1: ["F", "I", "RECV_F", "SEND_B", "W"] + (["RECV_B", "SEND_F"] if schedule == "interleaved-1f1b" else [])}
    for rank, results in enumerate(two_ranks):
        case = results[("split", schedule)]
        assert [s["bitwise"] and s["loss_equal"] for s in case["steps"]] == [True, True], (rank, case)
        assert case["params_equal"] is True
        assert case["ops"] == sorted(ops[rank])


def test_split_backward_of_every_stage_with_recompute_is_bitwise(two_ranks):
    for rank, results in enumerate(two_ranks):
        case = results["split_all"]
        assert [s["bitwise"] and s["loss_equal"] for s in case["steps"]] == [True, True], (rank, case)
        expected = ["F", "I", "R", "RECV_B", "SEND_F", "W"] if rank == 0 else ["F", "I", "R", "RECV_F", "SEND_B", "W"]
        assert case["ops"] == expected


def test_split_backward_four_ranks_interleaved_and_with_data_parallel(four_ranks):
    for rank, results in enumerate(four_ranks):
        case = results["split"]
        assert [s["bitwise"] and s["loss_equal"] for s in case["steps"]] == [True, True], (rank, case)
        assert "W" in case["ops"] and "I" in case["ops"]
        dp = results["dp_split"]
        assert dp["grads"] == 8 and dp["worst"] <= 1e-6 and dp["loss_equal"] is True, (rank, dp)


def test_a_layer_shared_by_two_stages_of_one_rank_is_stepped_once_and_averaged_once(four_ranks):
    # interleaved, p=2 x v=2, dp=2: layer 4 is layer 0, so stages 0 and 2 (both on pipeline rank 0) share it
    for rank, results in enumerate(four_ranks):
        case = results["dp_tied"]
        expected = 6 if case["pp_rank"] == 0 else 8  # rank 0: layers 0, 1, 5 (4 is 0); rank 1: 2, 3, 6, 7
        assert (case["grads"], case["params"]) == (expected, expected), (rank, case)
        assert case["worst"] <= 1e-6 and case["loss_equal"] is True, (rank, case)
