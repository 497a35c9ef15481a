"""save_checkpoint/load_checkpoint arguments that every rank must agree on (the same path and step; an optimizer
on every rank holding parameters or on none): a clear error on every rank naming both ranks and values, before
anything is read; a rank whose stages hold no parameters passes optimizer=None and the resume is still exact; a
GradScaler's state kept in ``extra`` resumes fp16 training exactly. One 2-rank launch for the module."""
import os

import pytest
import torch

from pipesched.runtime import launch

import rt_checkpoint_agreement


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    return {"root": str(root), "ranks": launch(rt_checkpoint_agreement.everything, 2, str(root), timeout=300)}


def both(runs, part, case):
    return [part_of(r, part)[case] for r in runs["ranks"]]


def part_of(rank_result, part):
    result = rank_result[part]
    assert "raised" not in result, result  # the part itself raised on this rank
    return result


def test_ranks_loading_different_paths_fail_on_every_rank(runs):
    folder = os.path.join(runs["root"], "mismatches")
    expected = ("ValueError", f"load_checkpoint: world rank 1 gave path={os.path.join(folder, 'step-2')!r} but world "
                f"rank 0 path={os.path.join(folder, 'step-1')!r}; every rank must pass the same path")
    assert both(runs, "mismatches", "load_path") == [expected, expected]


OPT_MESSAGE = ("{caller}: world rank {given} gave an optimizer but world rank {missing} optimizer=None although its "
               "stages hold parameters; every rank must pass its optimizer, or every rank None (only a rank whose "
               "stages hold no parameters may pass None while the others pass theirs)")


def test_an_optimizer_on_one_rank_only_fails_on_every_rank(runs):
    load = ("ValueError", OPT_MESSAGE.format(caller="load_checkpoint", given=0, missing=1))
    save = ("ValueError", OPT_MESSAGE.format(caller="save_checkpoint", given=1, missing=0))
    assert both(runs, "mismatches", "load_opt_one_rank") == [load, load]
    assert both(runs, "mismatches", "save_opt_one_rank") == [save, save]


def test_ranks_saving_different_steps_fail_on_every_rank(runs):
    expected = ("ValueError", "save_checkpoint: world rank 1 gave step=4 but world rank 0 step=3; every rank must "
                              "pass the same step")
    assert both(runs, "mismatches", "save_step") == [expected, expected]


def test_nothing_is_loaded_or_saved_after_a_refusal_and_agreeing_ranks_load(runs):
    for r in (part_of(x, "mismatches") for x in runs["ranks"]):
        assert r["unchanged"] is True  # weights bitwise the fresh init, AdamW state still empty
        assert r["saved"] == ["step-1", "step-2"]  # the refused saves wrote nothing (not even hidden)
        assert r["loaded"] == (2, True)  # rank 0 relative, rank 1 absolute: the same path, bitwise


def test_a_rank_without_parameters_passes_no_optimizer_and_resumes_exactly(runs):
    first, second = (part_of(r, "no_parameters") for r in runs["ranks"])
    assert (first["opt_is_none"], second["opt_is_none"]) == (False, True)  # rank 1: only a Tanh
    for r in (first, second):
        assert r["save"] is None
        assert r["info"] == (2, True)
        assert r["half"] == r["straight"][:2] and r["resumed"] == r["straight"][2:]  # losses bitwise
        assert sorted(r["resumed_state"]) == sorted(r["straight_state"])
        assert all(torch.equal(t, r["straight_state"][n]) for n, t in r["resumed_state"].items())
    assert len(set(second["straight"])) == 4  # the loss moves


def test_a_grad_scaler_in_extra_resumes_fp16_training_exactly(runs):
    for r in (part_of(x, "scaler") for x in runs["ranks"]):
        # 2^18 overflows at step 0 -> 2^17; growth every 2 overflow-free steps; saved mid-count (tracker 1)
        assert [s for _, s in r["straight"]] == [2.0 ** 17, 2.0 ** 17, 2.0 ** 18, 2.0 ** 17, 2.0 ** 17, 2.0 ** 18]
        assert r["saved_scaler"] == {"scale": 2.0 ** 17, "growth_factor": 2.0, "backoff_factor": 0.5,
                                     "growth_interval": 2, "_growth_tracker": 1}
        assert r["extra"] == {"scaler": r["saved_scaler"]}  # through JSON: floats and ints unchanged
        assert r["half"] == r["straight"][:2] and r["resumed"] == r["straight"][2:]  # losses bitwise, same scales
        assert r["resumed_scaler"] == r["straight_scaler"]
        assert all(torch.equal(t, r["straight_state"][n]) for n, t in r["resumed_state"].items())
