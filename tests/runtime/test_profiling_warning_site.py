"""profile_layers' warnings (wall-clock timing with more than one torch thread; a model that cannot run on fewer
rows) point at the line that called profile_layers, not inside pipesched. One process."""
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


def _warnings_of(model, sample, threads_to_use):
    torch.set_num_threads(threads_to_use)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile_layers(model, sample, repeat=1, warmup=0)
    return [(str(w.message).split(",")[0].split(" (")[0], w.filename) for w in caught]


def test_the_wall_clock_warning_points_at_the_caller(threads):
    found = _warnings_of(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4), 2)
    assert found == [("profile_layers: torch runs 2 intra-op threads in this process", __file__)]


def test_the_smaller_size_warning_points_at_the_caller(threads):
    found = _warnings_of(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), torch.randn(2, 4), 1)
    assert found == [("profile_layers: the model does not run on 1 of the sample's 2 rows", __file__)]
