"""zbv and dualpipev in Pipeline: V placement (first and last stage on pipeline rank 0, neighbours sending both
ways), I and W (zbv: on every stage; dualpipev: mixed with B on one stage); gradients, losses and weights bitwise
equal to the unsplit model's, on 2 and 4 ranks and DP x PP."""
import pytest

from pipesched.runtime import launch

import rt_v_shape

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def two_ranks():
    return launch(rt_v_shape.two_rank_suite, 2, timeout=240)


@pytest.fixture(scope="module")
def four_ranks():
    return launch(rt_v_shape.four_rank_suite, 4, timeout=240)


def _bitwise(case, steps):
    """Every step's gradients bitwise and loss exactly equal to the unsplit model's, and the weights after AdamW."""
    assert [(s["bitwise"], s["loss_equal"]) for s in case["steps"]] == [(True, True)] * steps, case
    assert case["params_equal"] is True, case
    assert case["events"] == case["stream"]  # the measured timeline has one event per instruction


@pytest.mark.parametrize("m", [1, 3, 4, 5])
def test_two_ranks_bitwise_for_any_m(two_ranks, m):
    for results in two_ranks:  # 10 rows into m microbatches: uneven for m = 3 and 4
        _bitwise(results[("m", m)], 2)
        assert results[("m", m)]["ops"] == ["F", "I", "RECV_B", "RECV_F", "SEND_B", "SEND_F", "W"]
        # 8 Linear layers in 4 stages of 2: each rank holds 2 stages, 4 layers, a weight and a bias each
        assert [s["grads"] for s in results[("m", m)]["steps"]] == [8, 8]


@pytest.mark.parametrize("case", ["recompute", "program_order", "uneven"])
def test_two_ranks_bitwise_with_recompute_and_program_order(two_ranks, case):
    for results in two_ranks:
        _bitwise(results[case], 1 if case == "uneven" else 2)
    assert "R" in two_ranks[0]["recompute"]["ops"]


def test_forward_output_lands_on_rank_0_the_last_stages_rank(two_ranks, four_ranks):
    assert [r["forward"] for r in two_ranks] == [True, None]
    assert [r["forward"] for r in four_ranks] == [True, None, None, None]


def test_each_pair_sends_both_ways_in_one_order_on_both_sides(two_ranks):
    flip = {"send": "recv", "recv": "send"}
    for early in (True, False):
        zero, one = two_ranks[0][("order", early)], two_ranks[1][("order", early)]
        assert {k for k, _, _ in zero} == {k for k, _, _ in one} == {"send", "recv"}
        mirrored = [(flip[k], tag) for k, _, tag in zero]
        if early:  # gloo matches by tag: each message has its receive, in any order
            assert sorted(mirrored) == sorted((k, tag) for k, _, tag in one)
        else:  # program order (NCCL's discipline): the same sequence on both sides
            assert mirrored == [(k, tag) for k, _, tag in one]


def test_bad_virtual_stages_is_refused_on_every_rank(two_ranks):
    expect = ("ScheduleArgumentError", "virtual_stages",
              "virtual_stages=3: zbv places exactly two stages per rank in a V, so virtual_stages must be 2 "
              "(use interleaved-1f1b for other counts)")
    assert [r["bad_v"] for r in two_ranks] == [expect, expect]


def test_a_fault_on_an_up_stage_ends_every_rank_with_its_origin(two_ranks):
    for results in two_ranks:
        err = results["failure"]
        assert (err["rank"], err["instr"], err["cause"]) == (1, "F2.1", "ValueError: boom at microbatch 1"), err
        assert err["elapsed"] < 20.0  # the timeout is 30 s: nobody waited for it


@pytest.mark.parametrize("m", [2, 4, 7, 8])
def test_four_ranks_bitwise(four_ranks, m):
    for results in four_ranks:
        _bitwise(results[("m", m)], 2)


def test_four_ranks_recompute_bitwise(four_ranks):
    for results in four_ranks:
        _bitwise(results["recompute"], 2)
        assert "R" in results["recompute"]["ops"]


@pytest.mark.parametrize("case", ["dp", "dp_recompute"])
def test_dp2_x_pp2_grads_are_bitwise_the_mean_of_the_shards(four_ranks, case):
    layout = []
    for results in four_ranks:
        res = results[case]
        layout.append((res["dp_rank"], res["pp_rank"]))
        # (g0 + g1) / 2 of the unsplit model's shard gradients, exactly: a sum of two is the same in any order
        assert (res["grads"], res["worst"], res["loss_equal"]) == (8, 0.0, True), res
    assert layout == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("m", [1, 3, 4, 6, "recompute"])
def test_dualpipev_two_ranks_bitwise(two_ranks, m):
    for results in two_ranks:
        case = results[("dualpipev", m)]
        _bitwise(case, 2)
        assert {"B", "F", "RECV_B", "RECV_F", "SEND_B", "SEND_F"} <= set(case["ops"])
    if m in (4, 6, "recompute"):  # m >= 2p: the drain splits every rank's last backwards into I and W
        assert all({"I", "W"} <= set(r[("dualpipev", m)]["ops"]) for r in two_ranks)


@pytest.mark.parametrize("m", [3, 8])
def test_dualpipev_four_ranks_bitwise(four_ranks, m):
    for results in four_ranks:
        _bitwise(results[("dualpipev", m)], 2)


def test_dualpipev_dp2_x_pp2_bitwise_mean(four_ranks):
    for results in four_ranks:
        res = results[("dualpipev", "dp")]
        assert (res["grads"], res["worst"], res["loss_equal"]) == (8, 0.0, True), res


def test_a_weight_tied_between_first_and_last_stage_stays_on_rank_0(two_ranks):
    """The V puts stage 0 and the last stage on rank 0: no TIE_REDUCE. Their gradient contributions reach .grad one
    W at a time ((g + a) + b where the unsplit model adds g + (a + b)), so the tied weight is equal to rounding:
    relative difference <= 1e-6; every other gradient of step 1 (before the weights differ) is bitwise."""
    for rank, results in enumerate(two_ranks):
        case = results["tied"]
        assert case["tie_reduces"] == 0
        (loss_equal, count, bitwise, worst), later = case["steps"]
        assert (loss_equal, count) == (True, 6 if rank == 0 else 8)  # rank 0: 3 distinct Linear layers
        assert bitwise is (rank == 1) and worst <= 1e-6, case
        assert later[3] <= 1e-6, case
