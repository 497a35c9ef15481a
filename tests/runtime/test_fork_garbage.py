"""A forked launch child never collects what it inherited: a 1-rank Pipeline dropped in the parent leaves torch
objects of a destroyed process group in cycles, whose destructors, run in a forked child, waited forever on threads
the child does not have (test_lost_rank and test_stalled hung after test_single_process in one pytest session).
launch collects the parent's garbage before it forks and freezes what a child inherited."""
import gc
import warnings

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from pipesched.runtime import Pipeline, launch

import rt_fork_garbage
from rt_cases import mlp

pytestmark = pytest.mark.multiprocess


def test_a_forked_child_collecting_garbage_after_a_one_rank_pipeline_finishes(no_launcher):
    gc.disable()  # keep the dropped Pipeline's cycles as garbage until launch
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the 1-rank Pipeline's SingleProcessWarning
            Pipeline(mlp(num_layers=2), num_microbatches=2, loss_fn=F.mse_loss)
        dist.destroy_process_group()
        assert launch(rt_fork_garbage.collect, 2, timeout=60, start_method="fork") == [0, 1]
    finally:
        gc.enable()
