"""Parameters tied across pipeline ranks (2 ranks): gradients, optimizer steps and the construction check, against
the unsplit model. Tied gradients and the weights they update: within rtol 1e-5, atol 1e-6 (float32; the same
terms summed in another order); untied gradients of the first step: bitwise (later steps start from weights that
differ by that rounding)."""
import pytest

from pipesched.runtime import launch

import rt_tied

KEYS = [(schedule, label, optim) for schedule, _, _ in rt_tied.CASES for label in rt_tied.OPTIONS
        for optim in (("sgd", "adamw") if label == "plain" else ("adamw",))]


@pytest.fixture(scope="module")
def results():
    return launch(rt_tied.suite, 2, timeout=300)


@pytest.mark.parametrize("key", KEYS, ids=["-".join(k) for k in KEYS])
def test_gradients_and_weights_equal_the_unsplit_model_and_the_copies_stay_identical(results, key):
    for res in results:
        case = res[key]
        assert [s["close"] for s in case["steps"]] == [True] * 3, case
        assert case["steps"][0]["untied_exact"] is True, case  # later steps start from weights a rounding apart
        assert case["weights_close"] is True
    copies = [[s["copies"] for s in res[key]["steps"]] for res in results]
    for step in range(3):  # every tied copy on rank 0 is bitwise the one on rank 1 after each optimizer step
        assert copies[0][step] == copies[1][step] and len(copies[0][step]) == 2, copies
    assert results[0][key]["steps"][-1]["loss"] == results[1][key]["steps"][-1]["loss"]


@pytest.mark.parametrize("key", KEYS, ids=["-".join(k) for k in KEYS])
def test_ties_are_found_and_each_rank_runs_one_tie_reduce(results, key):
    schedule = key[0]
    if schedule == "interleaved-1f1b":  # stages [emb, La], [Tanh, Lb], [Tanh, Lc], [Head]: 0, 2 on rank 0
        ties = [(("0.weight", "6.weight"), (0, 3), (0, 1), 0),
                (("1.weight", "3.weight", "5.weight"), (0, 1, 2), (0, 1), 0)]
        program_ties = ((0, 3), (0, 1, 2))
        tie_reduce = ["TIE_REDUCE0", "TIE_REDUCE1"]  # rank 0: stage 0's backward ends after stage 2's
    else:  # stages [emb, La, Tanh, Lb], [Tanh, Lc, Head]
        ties = [(("0.weight", "6.weight"), (0, 1), (0, 1), 0),
                (("1.weight", "3.weight", "5.weight"), (0, 1), (0, 1), 0)]
        program_ties = ((0, 1),)  # one group: both parameters are summed by one collective
        tie_reduce = ["TIE_REDUCE0", "TIE_REDUCE1"]
    for rank, res in enumerate(results):
        case = res[key]
        assert case["ties"] == ties
        assert case["program_ties"] == program_ties
        assert case["tie_reduce"] == [tie_reduce[rank]]
        assert case["measured"] == [tie_reduce[rank]]  # in the measured timeline too
        assert case["predicted"] == tie_reduce  # and in its simulation (the ties ride in its meta)
    # counted once: the owner (stage 0, rank 0) counts both tied weights; rank 1 only its own biases
    own = {0: ["0.weight", "1.bias", "1.weight", "3.bias"], 1: ["5.bias"]}  # names as the unsplit model lists them
    if schedule == "interleaved-1f1b":  # rank 0: [emb, La] and [Tanh, Lc]; rank 1: [Tanh, Lb] and [Head]
        own = {0: ["0.weight", "1.bias", "1.weight", "5.bias"], 1: ["3.bias"]}
    assert [res[key]["counted"] for res in results] == [own[0], own[1]]


def test_a_tie_whose_copies_differ_is_refused_on_every_rank(results):
    expect = ("tied parameter 0.weight = 6.weight (stages [0, 1]) has different values on world rank 0 (pipeline "
              "rank 0) and world rank 1 (pipeline rank 1); its copies must be identical at construction")
    for res in results:
        assert expect in res["differ"], res["differ"]
