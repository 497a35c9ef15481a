"""A stage whose first layer has ``inplace=True`` (nn.ReLU(inplace=True) where balance=None cuts, LeakyReLU,
Hardtanh, nested in a block) gets a copy of its input and trains bitwise as the unsplit model: 1f1b, gpipe with
recompute, split backward, zbv (an input from a stage on the same rank), interleaved with recompute. Stage 0 gets
no copy (its input is the microbatch, as in the unsplit model). Another in-place write to a stage input stays a
clear error (tests/runtime/test_failure.py). 2 spawned gloo ranks."""
import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.stage import ClonedInputStage, build_stages, inplace_first

import rt_inplace_first_layer


@pytest.fixture(scope="module")
def results():
    return launch(rt_inplace_first_layer.suite, 2, timeout=240)


#: per case, per pipeline rank: the stages that get a copy of their input
CLONED = {"relu-1f1b": [[], [1]], "relu-gpipe-recompute": [[], [1]], "relu-1f1b-split": [[], [1]],
          "each-zbv": [[3], [1, 2]], "each-interleaved-recompute": [[2], [1, 3]]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(rt_inplace_first_layer.CASES))
def test_in_place_first_layers_train_bitwise(results, name):
    for rank, res in enumerate(results):
        case = res[name]
        assert case["cloned"] == CLONED[name][rank], (rank, case)
        assert all(loss and equal and count > 0 for loss, count, equal in case["steps"]), (rank, case)
        assert case["params_equal"] is True, (rank, case)


def test_which_layers_count_as_in_place():
    assert inplace_first(nn.ReLU(inplace=True)) and inplace_first(nn.Dropout(0.1, inplace=True))
    assert inplace_first(nn.Sequential(nn.Sequential(nn.ReLU(True), nn.Linear(2, 2)), nn.Linear(2, 2)))
    assert not inplace_first(nn.ReLU()) and not inplace_first(nn.Linear(2, 2)) and not inplace_first(nn.Sequential())
    assert not inplace_first(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))  # not first


def test_the_copy_leaves_keys_and_the_callers_tensor_alone():
    layers = [nn.Linear(2, 2), nn.ReLU(inplace=True), nn.Linear(2, 2)]
    stages = build_stages(layers, [1, 2], [0, 1])
    assert type(stages[0]) is nn.Sequential and type(stages[1]) is ClonedInputStage
    assert list(stages[1].state_dict()) == ["1.weight", "1.bias"]
    x = torch.tensor([[-1.0, 2.0]])
    stages[1](x)
    assert x.tolist() == [[-1.0, 2.0]]  # the stage wrote its copy
    pair = (torch.tensor([-1.0]), 3)
    assert ClonedInputStage(nn.Identity())(pair)[0] is not pair[0]
