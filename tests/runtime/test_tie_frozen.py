"""Tied weights whose copies' gradients differ in presence, and state_dict() of a rank holding only a tied copy
(2 ranks, balance [4, 2]: rank 1's only parameter is the LM head, tied to the embedding), against the unsplit model.
Bodies in rt_tie_frozen.py."""
import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.ties import TiedParameter, find_ties

import rt_tie_frozen

OPTIONS = ("plain", "split")


@pytest.fixture(scope="module")
def results():
    return launch(rt_tie_frozen.suite, 2, timeout=300)


def _same_on_both_ranks(results, key):
    a, b = (res[key] for res in results)
    assert a["grad_digests"] == b["grad_digests"], key  # every copy's .grad: the same bits (None alike)
    assert a["weight_digest"] == b["weight_digest"], key  # and the copies after AdamW with weight decay


@pytest.mark.parametrize("options", OPTIONS)
def test_a_tie_frozen_at_construction_then_unfrozen_is_summed(results, options):
    # step 1 frozen: .grad None on both copies, as the unsplit model's; steps 2 and 3: the unsplit model's gradient
    # (the sum of both uses) on both copies to RTOL 1e-5 (the same terms summed in another order)
    for res in results:
        case = res[("unfreeze", options)]
        assert case["steps"] == [(True, True, True), (False, False, True), (False, False, True)], case
        assert case["grad_digests"][0] is None and None not in case["grad_digests"][1:]
        assert case["weight_close"] is True
    _same_on_both_ranks(results, ("unfreeze", options))


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("kind", ["frozen", "detach_both"])
def test_a_tie_without_any_gradient_keeps_grad_none_and_its_weights(results, kind, options):
    # frozen throughout, or trainable with no use reached: no copy has a gradient, every .grad stays None (not
    # zeros), so AdamW's weight decay leaves the weight bitwise as the unsplit model's (unchanged)
    for res in results:
        case = res[(kind, options)]
        assert case["steps"] == [(True, True, True)] * 3 and case["grad_digests"] == [None] * 3, case
        assert case["weight_bitwise"] is True
    _same_on_both_ranks(results, (kind, options))


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("kind", ["detach_head", "detach_emb"])
def test_a_tie_used_on_one_rank_only_gives_every_copy_that_gradient(results, kind, options):
    # one use produces no gradient (its copy's .grad is None before the sum): every copy gets the other use's,
    # the unsplit model's bit for bit (sum with zeros), and the weights stay bitwise the unsplit model's
    for res in results:
        case = res[(kind, options)]
        assert case["steps"] == [(False, False, True)] * 3, case
        assert case["weight_bitwise"] is True
    _same_on_both_ranks(results, (kind, options))


def test_construction_compares_the_copies_of_a_frozen_tie(results):
    expect = ("tied parameter 0.weight = 5.weight (stages [0, 1]) has different values on world rank 0 (pipeline "
              "rank 0) and world rank 1 (pipeline rank 1); its copies must be identical at construction: build the "
              "model the same way on every rank (same seed, same initialisation) before Pipeline(...)")
    assert [res["differ"] for res in results] == [expect, expect]


def test_state_dict_holds_a_tied_copy_under_its_first_name_and_round_trips(results):
    rank0, rank1 = (res["state"] for res in results)
    assert rank0["keys"] == ["0.weight", "2.weight", "2.bias"]
    assert rank1["keys"] == ["0.weight"]  # the head's weight, stored under the tie's first name
    for state in (rank0, rank1):
        assert state["shares"] is True and state["loaded"] is True and state["round_trip"] == ([], [])


def test_a_missing_entry_names_the_rank_that_needs_it_and_why(results):
    rank0, rank1 = (res["state"] for res in results)
    tail = (": a state dict must hold every tensor of the rank that loads it (the unsplit model's state_dict(), or "
            "this rank's own Pipeline.state_dict()); strict=False skips the missing ones")
    assert rank0["missing"] == ("the state dict has no entry for '0.weight' (shape (16, 8)), which pipeline rank 0 "
                                "needs for its stage 0 (layer 0's '0.weight')" + tail)
    assert rank1["missing"] == ("the state dict has no entry for '0.weight' (shape (16, 8)), which pipeline rank 1 "
                                "needs for its stage 1 (layer 5's '5.weight', a tied copy stored under its first "
                                "name)" + tail)


def test_find_ties_counts_frozen_parameters_not_buffers():
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    emb.weight.requires_grad_(False)
    norm_a, norm_b = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    norm_b.running_mean = norm_a.running_mean  # a shared buffer: not a tie
    ties = find_ties([emb, norm_a, norm_b, head], [2, 2], [0, 1])
    assert ties == (TiedParameter(("0.weight", "3.weight"), (0, 1), (0, 1), 0),)
    assert torch.equal(emb.weight, head.weight)
