"""A checkpoint of a model with a tied weight (embedding = head) does not depend on the rank count: one rank's
Pipeline stores the tie once under its first name as two ranks' do ('4.weight' was stored too on 1 rank, and a
checkpoint from 2 ranks then failed to load on 1 with "has no entry for '4.weight'": new-user trial, bug2; the demo's
`--ranks 2` then `--ranks 1 --resume` hit it). Saved on 2 ranks and loaded on 1, and back; forked gloo ranks."""
import pytest
import torch

from pipesched.runtime import launch

import rt_checkpoint_tied_ranks as rt

pytestmark = pytest.mark.multiprocess

ONE_RANK = ["0.weight", "1.bias", "1.weight", "3.bias", "3.weight", "4.bias"]


def _expected():
    return {k: v for k, v in rt.model(0).state_dict().items() if k != "4.weight"}


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (1, 2)])
def test_a_tied_checkpoint_loads_on_another_rank_count(tmp_path, saved_on, loaded_on):
    path = str(tmp_path / "ckpt")
    keys = launch(rt.save, saved_on, path, timeout=120, start_method="fork")
    if saved_on == 1:
        assert keys == [ONE_RANK]  # the tie once, under its first name, as the unsplit model's first use
    else:
        assert keys == [["0.weight", "1.bias", "1.weight"], ["0.weight", "3.bias", "3.weight", "4.bias"]]
    expected = _expected()
    for got in launch(rt.load, loaded_on, path, timeout=120, start_method="fork"):
        assert got["step"] == 1 and got["tied"] is True
        assert got["mine"], got
        for name, value in got["mine"].items():
            assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (1, 2)])
def test_a_buffer_shared_by_two_layers_is_stored_under_each_name_on_any_rank_count(tmp_path, saved_on, loaded_on):
    """Buffers are no ties: each rank holding one use stores it under that use's name, so one rank holding both
    stores both names (storing the first only, as for a tie, broke 1 -> 2 ranks: "no entry for '4.table'")."""
    path = str(tmp_path / "ckpt")
    keys = launch(rt.save, saved_on, path, "table", timeout=120, start_method="fork")
    names = ["0.weight", "1.table", "2.bias", "2.weight", "3.bias", "3.weight", "4.table", "5.bias", "5.weight"]
    assert sorted(sum(keys, [])) == names
    expected = rt.model(0, "table").state_dict()
    for got in launch(rt.load, loaded_on, path, "table", timeout=120, start_method="fork"):
        assert got["step"] == 1 and got["tied"] is True and got["mine"], got
        for name, value in got["mine"].items():
            assert torch.equal(value, expected[name]), name
