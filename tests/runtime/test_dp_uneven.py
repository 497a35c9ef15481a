"""Data parallelism with replicas of different batch sizes: every replica gets the unsplit model's whole-batch
gradient (each microbatch's loss weighted n * dp / N_all in backward, the replicas' batch sizes carried in the
replicas' agreement), the returned loss stays the replica's own; equal replica batches stay bitwise as before.

Tolerance: against the unsplit model the gradients are the same terms summed in another order (per microbatch,
then the all-reduce) in float32, so within RTOL = 1e-5 relative (atol RTOL * max |ref|); the bug this guards
against was off by 4e-2..2.6e-1. Equal replica batches are compared bitwise (torch.equal) with the same step
weighted n / N in backward as before the fix."""
from __future__ import annotations

import pytest
import torch

from pipesched.runtime import launch
from pipesched.runtime.step_run import loss_weights

import rt_dp_uneven as D

RTOL = 1e-5


def _close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


def test_loss_weights_are_n_over_N_for_equal_replicas_exactly():
    from pipesched.runtime.microbatch import split_sizes
    for dp in range(1, 9):
        for total in range(1, 130):
            for m in (1, 2, 3, 4, 7, 8):
                if m > total:
                    continue
                sizes = split_sizes(total, m)
                assert loss_weights(sizes, [total] * dp) == [n / total for n in sizes], (dp, total, m)
    assert loss_weights([3, 2], [5, 3]) == [6 / 8, 4 / 8]  # n * dp / N_all
    assert loss_weights([2, 1], [5, 3]) == [4 / 8, 2 / 8]


def _check(res, what):
    for rank, r in enumerate(res):
        for k, (loss, own) in enumerate(r["losses"]):
            assert _close(loss.reshape(()), own.reshape(())), (what, rank, k, float(loss), float(own))
        assert r["grads"], (what, rank)
        for name, (g, rg, _, _) in r["grads"].items():
            assert _close(g, rg), (what, rank, name, float((g - rg).abs().max() / rg.abs().max()))


@pytest.mark.parametrize("spec", D.SCHEDULES, ids=str)
def test_dp2_pp2_uneven_replicas_whole_batch_gradient(spec):
    # two steps accumulate (5 + 3 rows, then 3 + 7: the larger replica swaps), microbatches uneven too
    _check(launch(D.uneven, 4, 2, spec, [(5, 3), (3, 7)], timeout=600), spec)


def test_dp2_pp1_uneven_replicas_mean_and_sum_loss():
    spec = ("1f1b", 1, 2, False, False)
    _check(launch(D.uneven, 2, 1, spec, [(5, 3), (2, 6)], timeout=600), "mean")
    # a sum loss_fn: the same weights, so the gradient is sum over every replica's microbatch of S_i * n_i / N_all
    _check(launch(D.uneven, 2, 1, spec, [(5, 3)], D.SUM_MSE, timeout=600), "sum")


@pytest.mark.parametrize("pp,spec", [(2, ("zbv", 2, 2, True, True)), (2, ("1f1b", 1, 3, False, False)),
                                     (1, ("1f1b", 1, 2, False, True))], ids=str)
def test_equal_replica_batches_bitwise_as_before(pp, spec):
    for rank, r in enumerate(launch(D.equal_vs_before, 2 * pp, pp, spec, 5, timeout=600)):
        (loss, grads), (loss0, grads0) = r["now"], r["before"]
        assert torch.equal(loss, loss0), rank
        assert grads.keys() == grads0.keys() and grads, rank
        assert all(torch.equal(grads[n], grads0[n]) for n in grads), rank
