"""profile_layers on a CPU with more than one torch thread times by wall clock, which another process's load
inflates at random (a new-user trial's cut came out (6, 2) or (1, 7) for 8 identical layers): it warns and says to
call torch.set_num_threads(1), as the ranks run; with one thread (CPU time) it says nothing. One process."""
import warnings

import pytest
import torch
from torch import nn

from pipesched.runtime import profile_layers


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _profile():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile_layers(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4), repeat=1, warmup=0)
    return [str(w.message) for w in caught if "intra-op threads" in str(w.message)]


def test_more_than_one_thread_warns_that_layers_are_timed_by_wall_clock(threads):
    torch.set_num_threads(2)
    assert _profile() == [
        "profile_layers: torch runs 2 intra-op threads in this process, so the layers are timed by wall clock, which "
        "another process's load inflates at random (a balance='time' cut or a plan from it can come out lopsided); "
        "a pipeline's ranks run one thread (pipesched.runtime.launch, torchrun's OMP_NUM_THREADS=1): call "
        "torch.set_num_threads(1) first to time the layers as they run there, by CPU time"]


def test_one_thread_is_timed_by_cpu_time_without_a_warning(threads):
    torch.set_num_threads(1)
    assert _profile() == []
