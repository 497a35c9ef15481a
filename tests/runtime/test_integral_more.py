"""Numpy integers where the runtime takes an integer: Pipeline(balance=np.array([...])), profile_layers' ``repeat``,
``warmup`` and ``sizes``, save_checkpoint's ``step`` and launch's ``world_size`` become plain ints; a bool is still
refused with the existing message. One rank in this process (see test_single_process), one child for launch."""
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline, launch, load_checkpoint, save_checkpoint
from pipesched.runtime.profiling import profile_layers

from rt_cases import mlp

np = pytest.importorskip("numpy")


def one_rank_pipe(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SingleProcessWarning: one rank
        return Pipeline(mlp(num_layers=4), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, **kwargs)


def test_a_numpy_balance_builds_the_int_balance_and_steps(no_launcher):
    pipe = one_rank_pipe(balance=np.array([4]))
    assert pipe.balance == (4,) and type(pipe.balance[0]) is int
    g = torch.Generator().manual_seed(0)
    loss = pipe.step(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
    assert loss.shape == () and torch.isfinite(loss)
    pipe.close()


def test_a_bool_in_balance_is_refused(no_launcher):
    with pytest.raises(TypeError, match=r"balance must be None, 'params', 'time' or a list of ints, got \[True\]"):
        one_rank_pipe(balance=[True])


def test_a_numpy_step_is_saved_and_loaded_as_an_int(no_launcher, tmp_path):
    pipe = one_rank_pipe()
    save_checkpoint(tmp_path / "ckpt", pipe, step=np.int64(3))
    info = load_checkpoint(tmp_path / "ckpt", pipe)
    assert info.step == 3 and type(info.step) is int
    with pytest.raises(ValueError, match="step must be None or an int >= 0, got True"):
        save_checkpoint(tmp_path / "other", pipe, step=True)
    pipe.close()


def test_profile_layers_takes_numpy_repeat_warmup_and_sizes():
    profile = profile_layers(mlp(num_layers=2), torch.randn(4, 8), repeat=np.int64(1), warmup=np.int64(0),
                             sizes=np.array([2]))
    assert profile.num_layers == 2 and profile.microbatch_size == 4 and type(profile.microbatch_size) is int
    with pytest.raises(ValueError, match="repeat must be an int >= 1, got True"):
        profile_layers(mlp(num_layers=2), torch.randn(4, 8), repeat=True)
    with pytest.raises(ValueError, match=r"sizes must be ints in \[1, 4\] \(the sample's rows\), got \[True\]"):
        profile_layers(mlp(num_layers=2), torch.randn(4, 8), repeat=1, sizes=[True])


def _world(rank):
    return rank, os.environ["WORLD_SIZE"], torch.distributed.get_world_size()


def test_launch_takes_a_numpy_world_size():
    assert launch(_world, np.int64(1), timeout=120) == [(0, "1", 1)]
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got True"):
        launch(_world, True)
