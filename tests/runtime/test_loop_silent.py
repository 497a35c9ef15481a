"""Training-loop features combined, against the unsplit model (README "Correctness": one microbatch at a time, the
loss of microbatch i weighted by the Python float n_i / N, one thread): bodies in rt_loop_silent.py.

- 2 ranks, bitwise: a frozen Linear inside a stage, frozen -> trainable -> frozen between steps (zbv + recompute,
  zb-h1, dualpipev, zb-h2); a stage passing (float, int64) and one passing int64 only; stage 0 taking a (float,
  int64) tuple; uneven microbatches with a mean loss (10 rows into 4, 11 into 4 with recompute); BatchNorm with
  gradient accumulation over two steps (dualpipev + recompute) and training in eval() mode (zbv + recompute): every
  rank's loss, every .grad (None where the unsplit model's is None), the weights after AdamW with weight decay, the
  buffers.
- 2 ranks, within 1e-5 relative: an embedding tied to the head under zbv and dualpipev + recompute (both uses on
  rank 0, summed in another order: README "Correctness").
- dropout with recompute on and off (zbv, dualpipev with ties, 1f1b + split_backward): the same losses, gradients,
  next RNG draw, weights and forward() output, bitwise (the unsplit model cannot draw the ranks' masks).
- module full backward hooks and post-accumulate-grad hooks (zb-h1, zbv with a frozen first stage, dualpipev): the
  gradients bitwise, each hook called as often as in the unsplit model, and a layer seeing x.requires_grad as there.
- forward() in eval mode after a training step (zbv + recompute, dropout and BatchNorm): the unsplit output bitwise.
- 4 ranks, DP 2 x PP 2 zbv: GradScaler + unscale_ + clip_grad_norm_ + AdamW, 3 steps against torch.amp.GradScaler
  and clip_grad_norm_ on the unsplit model: the same scale each step, the norm, gradients and weights within 1e-5
  relative (the replicas' average adds in another order: README "Correctness" states 1e-6 for one step's gradient).
- a checkpoint saved under zbv on 2 ranks (Adam in two param groups, lrs changed by a "scheduler", a frozen layer)
  loaded under 1f1b on 1 rank: Adam's moments, step and lrs, then one more step, bitwise the unsplit model's; an
  embedding tied to the head, zbv on 2 ranks -> 1f1b on 2 ranks (the tie now across ranks), within 1e-5.
- DP replicas with different batch sizes (5 and 3 rows) get the whole batch's gradient (they got the average of
  their mean gradients before the replicas' agreement carried each one's batch size).
"""
import os

import pytest
import torch

from pipesched.runtime import launch

import rt_loop_silent as R

RTOL = 1e-5


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _close(a, b, rtol=RTOL):
    if a is None or b is None:
        return a is None and b is None
    return torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


@pytest.fixture(scope="module")
def two():
    return launch(R.two_rank_suite, 2, timeout=600)


def _check_case(res, case, equal):
    for rank, r in enumerate(res):
        out = r["cases"][case]
        for s, (loss, ref) in enumerate(out["loss"]):
            assert equal(loss, ref), (case, rank, s, loss, ref)
        for s, grads in enumerate(out["grads"]):
            assert grads, (case, rank)
            for name, (g, rg, _, _) in grads.items():
                assert equal(g, rg), (case, rank, s, name, g, rg)
        for name, (_, _, p, q) in out["params"].items():
            assert equal(p, q), (case, rank, name)
        for name, (b, rb) in out["buffers"].items():
            assert equal(b, rb), (case, rank, name, b, rb)
    assert _same(res[0]["cases"][case]["loss"][-1][0], res[1]["cases"][case]["loss"][-1][0])  # every rank's loss


@pytest.mark.parametrize("case", R.BITWISE)
def test_bitwise_the_unsplit_model(two, case):
    _check_case(two, case, _same)


def test_frozen_layer_grads_stay_none_while_frozen(two):
    # (the Frozen layers sit on rank 1 under the V: stages 1 and 2)
    grads = {n: g for r in two for n, g in r["cases"]["frozen_dualpipev"]["grads"][0].items()}
    frozen = [name for name in grads if ".b." in name]
    assert len(frozen) == 4 and all(grads[name][0] is None for name in frozen)
    toggled = [{n: g for r in two for n, g in r["cases"]["frozen_zbv_rc+toggle"]["grads"][s].items()}
               for s in range(3)]  # frozen, trainable, frozen again (zero_grad: None): gradients in step 2 only
    names = [name for name in toggled[0] if ".b." in name]
    assert len(names) == 4 and [all(toggled[s][n][0] is None for n in names) for s in range(3)] == [True, False, True]


@pytest.mark.parametrize("case", R.ROUNDED)
def test_tied_on_one_rank_within_rounding(two, case):
    _check_case(two, case, _close)


@pytest.mark.parametrize("spec", R.DROPOUT, ids=str)
def test_dropout_recompute_leaves_no_trace(two, spec):
    for rank, r in enumerate(two):
        plain, recomputed = r["dropout"][spec][False], r["dropout"][spec][True]
        for s, (a, b) in enumerate(zip(plain, recomputed)):
            assert _same(a[0], b[0]), (spec, rank, s, "loss / forward output")
            assert a[1].keys() == b[1].keys() and all(_same(a[1][n], b[1][n]) for n in a[1]), (spec, rank, s)
            assert torch.equal(a[2], b[2]), (spec, rank, s, "the next torch.rand")


@pytest.mark.parametrize("spec", R.HOOKS, ids=str)
def test_hooks_as_unsplit(two, spec):
    for rank, r in enumerate(two):
        out = r["hooks"][spec]
        assert _same(*out["loss"]), (spec, rank)
        assert all(_same(g, rg) for g, rg, _, _ in out["grads"].values()), (spec, rank)
        count, ref_count = out["count"]
        assert count and count == ref_count, (spec, rank)
        assert all(a == b for a, b in out["seen"].values()), (spec, rank, out["seen"])


def test_eval_forward_is_the_unsplit_output(two):
    outs = [r["eval"]["out"] for r in two]
    got = [o for o in outs if o[0] is not None]
    assert len(got) == 1 and torch.equal(*got[0])  # zbv: the output on rank 0
    assert all(g is None for r in two for g in r["eval"]["grads_after"])


def test_scaler_clip_zbv_dp2():
    res = launch(R.scaler_clip, 4, "zbv", 2, 2, timeout=600)
    for rank, steps in enumerate(res):
        for s, st in enumerate(steps[:-1]):
            assert st["scale"][0] == st["scale"][1], (rank, s, st["scale"])
            assert _close(*st["loss"]) and _close(*st["norm"]), (rank, s, st["loss"], st["norm"])
            assert st["norm"][0] > 0.05  # clipping was active
            assert all(_close(g, rg) for g, rg, _, _ in st["grads"].values()), (rank, s)
        assert all(_close(p, q) for _, _, p, q in steps[-1]["params"].values()), rank
    assert len({float(steps[0]["norm"][0]) for steps in res}) == 1  # the same norm on every rank


def _resume(tmp_path, save, load, kind):
    path = os.path.join(tmp_path, "ckpt")
    launch(R.ckpt_save, save[2], path, save[0], save[1], 2, kind, timeout=600)
    return launch(R.ckpt_load, load[2], path, load[0], load[1], 2, 2, kind, timeout=600)


def _check_resume(res, equal):
    for rank, o in enumerate(res):
        assert o["step"] == 2 and o["moments"], rank
        for name, moments in o["moments"].items():
            for key, (a, b) in moments.items():
                assert equal(torch.as_tensor(a), torch.as_tensor(b)), (rank, name, key, a, b)
        assert all(a == b for a, b in o["lrs"].values()), (rank, o["lrs"])
        assert all(equal(p, q) for _, _, p, q in o["before"].values()), rank
        assert equal(*o["loss"]), (rank, o["loss"])
        assert all(equal(g, rg) and equal(p, q) for g, rg, p, q in o["after"].values()), rank


def test_checkpoint_zbv_2_ranks_to_1f1b_1_rank(tmp_path):
    res = _resume(tmp_path, ("zbv", 2, 2), ("1f1b", 1, 1), "frozen")
    assert res[0]["frozen_requires_grad"] == ["1.b.weight", "1.b.bias"]
    _check_resume(res, _same)


def test_checkpoint_tied_zbv_to_1f1b(tmp_path):
    _check_resume(_resume(tmp_path, ("zbv", 2, 2), ("1f1b", 1, 2), "tied"), _close)


def test_dp_replicas_of_different_batch_sizes_get_the_whole_batch_gradient():
    res = launch(R.dp_uneven, 2, (5, 3), 1, timeout=600)
    for o in res:
        assert all(_close(g, rg) for g, rg, _, _ in o["grads"].values())
