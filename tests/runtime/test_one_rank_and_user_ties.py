"""Ties the V placement keeps on one rank, and ties in a user's Program, on 2 ranks against the unsplit model (one
launch: tests/runtime/rt_one_rank_and_user_ties.py). Tolerances as tests/runtime/test_tied.py: a tied weight's gradient (and
the weights it updates) within rtol 1e-5, atol 1e-6 (float32: the unsplit model adds the two uses per microbatch, the
pipeline adds each use over the microbatches, the same terms in another order); every other gradient of the first
step, and the loss, bitwise."""
import pytest

from pipesched.runtime import launch

import rt_one_rank_and_user_ties
from rt_tied import ATOL, RTOL


@pytest.fixture(scope="module")
def results():
    return launch(rt_one_rank_and_user_ties.suite, 2, timeout=400)


def _check_steps(results, case):
    for res in results:
        got = case(res)
        assert [s["close"] for s in got["steps"]] == [True, True], got
        assert got["steps"][0]["untied_exact"] is True, got
        assert got["weights_close"] is True
    copies = [[s["copies"] for s in case(res)["steps"]] for res in results]
    shared = set(copies[0][0]) & set(copies[1][0])  # the tied weights both ranks hold: bitwise the same copies
    assert shared and all({n: c[n] for n in shared} == {n: copies[1][k][n] for n in shared}
                          for k, c in enumerate(copies[0]))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_v_keeps_the_embedding_and_head_on_rank_0_without_a_tie_reduce(results, schedule):
    _check_steps(results, lambda res: res["v"][schedule])
    for rank, res in enumerate(results):
        case = res["v"][schedule]
        assert case["ties"] == [(("0.weight", "6.weight"), (0, 3), (0,), 0),  # one rank: autograd sums the uses
                                (("1.weight", "3.weight", "5.weight"), (0, 1, 2), (0, 1), 0)]
        assert case["program_ties"] == ((0, 1, 2),)  # only the tie across ranks is reduced
        assert case["tie_reduce"] == [["TIE_REDUCE0"], ["TIE_REDUCE1"]][rank]
        assert case["measured"] == case["tie_reduce"] and case["predicted"] == ["TIE_REDUCE0", "TIE_REDUCE1"]
    assert [res["v"][schedule]["counted"] for res in results] == [["0.weight", "1.bias", "1.weight"],
                                                                   ["3.bias", "5.bias"]]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_an_embedding_tied_to_the_head_only_needs_no_collective(results, schedule):
    for rank, res in enumerate(results):
        case = res["v"][f"{schedule}-embedding-head"]
        assert case["ties"] == [(("0.weight", "6.weight"), (0, 3), (0,), 0)]
        assert case["program_ties"] == () and case["tie_reduce"] == 0 and case["loss_equal"] is True
        untied = {n: g for n, g in case["grads"].items() if n != "0.weight"}
        assert untied and all(equal for equal, _ in untied.values()), case
        assert sorted(case["grads"]) == [["0.weight", "1.bias", "1.weight"],
                                         ["3.bias", "3.weight", "5.bias", "5.weight"]][rank]
        if rank == 0:  # the tied weight: its two uses summed in another order (see the module docstring)
            assert case["grads"]["0.weight"][1] <= ATOL + RTOL * case["scale"], case


@pytest.mark.parametrize("label", ["plain", "tied", "reordered"])
def test_a_users_program_runs_with_the_models_ties(results, label):
    _check_steps(results, lambda res: res["user"][label])
    for rank, res in enumerate(results):
        case = res["user"][label]
        expect = ((0, 1, 2), (0, 3)) if label == "reordered" else ((0, 1),)  # the program's order is kept
        assert case["program_ties"] == expect
        assert case["tie_reduce"] == case["measured"] == [["TIE_REDUCE0"], ["TIE_REDUCE1"]][rank]
    for rank, res in enumerate(results):  # a program with ties runs its own TIE_REDUCE as given
        assert res["user"]["tied"]["given_tie_reduce"] == res["user"]["tied"]["tie_reduce"]


def test_a_program_whose_ties_are_not_the_models_is_refused_on_every_rank_naming_both(results):
    for res in results:
        assert res["refused"]["missing"] == (
            "the program's ties ((0, 3)) differ from the model's (stages sharing a parameter on two ranks or more: "
            "(0, 3), (0, 1, 2)); give the program without ties and TIE_REDUCE (the Pipeline adds them for the model), "
            "or compile it with ties=[(0, 3), (0, 1, 2)]")
        assert res["refused"]["extra"] == (
            "the program's ties ((0, 1)) differ from the model's (stages sharing a parameter on two ranks or more: "
            "none); give the program without ties and TIE_REDUCE (the Pipeline adds them for the model), or compile "
            "it without ties")
