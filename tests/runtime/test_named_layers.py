"""A Pipeline names tensors as the unsplit model does: each layer's key in the ``nn.Sequential``, not its index. For
``nn.Sequential(OrderedDict(embed=..., ...))`` the model's ``state_dict()`` says ``"embed.weight"``; the Pipeline said
``"0.weight"``, so ``pipe.load_state_dict(model.state_dict())`` failed (strict) or silently loaded nothing
(``strict=False``), and checkpoints, ties and error messages used names the model does not have. 2 forked gloo
ranks; the model (tests/runtime/rt_named_layers.py) is cut 3 + 2: rank 0 embed, block0, norm (BatchNorm buffers);
rank 1 block1, head (head.weight tied to embed.weight)."""
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from pipesched.runtime import launch, load_into
from pipesched.runtime.stage import layer_names, layers_of
from pipesched.runtime.state import state_spec

import rt_named_layers as rt

pytestmark = pytest.mark.multiprocess

NAMES = ("embed", "block0", "norm", "block1", "head")
KEYS = [
    ["embed.weight", "block0.0.weight", "block0.0.bias", "norm.weight", "norm.bias", "norm.running_mean",
     "norm.running_var", "norm.num_batches_tracked"],
    ["embed.weight", "block1.weight", "block1.bias", "head.bias"],  # the tied head under its first name
]
SPEC = ["embed.weight", "block0.0.weight", "block0.0.bias", "norm.weight", "norm.bias", "norm.running_mean",
        "norm.running_var", "norm.num_batches_tracked", "block1.weight", "block1.bias", "head.weight", "head.bias"]
PARAMETERS = ["embed.weight", "block0.0.weight", "block0.0.bias", "norm.weight", "norm.bias", "block1.weight",
              "block1.bias", "head.bias"]


def test_layer_names_are_the_models_own_keys():
    named = rt.model(0)
    assert layer_names(named) == list(NAMES)
    assert list(state_spec(layers_of(named), layer_names(named))) == SPEC == list(named.state_dict())
    plain = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    assert layer_names(plain) == ["0", "1", "2"]
    assert list(state_spec(layers_of(plain), layer_names(plain))) == list(plain.state_dict())
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert layer_names(layers) == layer_names(tuple(layers)) == layer_names(nn.ModuleList(layers)) == ["0", "1"]
    with pytest.raises(TypeError, match="model must be an nn.Sequential"):
        layer_names(nn.Linear(2, 2))


@pytest.fixture(scope="module")
def loads():
    return launch(rt.names_and_loads, 2, timeout=180, start_method="fork")


def test_state_dict_keys_ties_and_layer_names_are_the_unsplit_models(loads):
    for rank, got in enumerate(loads):
        assert got["layer_names"] == NAMES
        assert got["keys"] == KEYS[rank]
        assert got["ties"] == [("embed.weight", "head.weight")]


def test_the_unsplit_models_state_dict_loads_strict_and_not(loads):
    reference, other = rt.model(0).state_dict(), rt.model(2).state_dict()
    for rank, got in enumerate(loads):
        assert not torch.equal(got["initial"]["embed.weight"], reference["embed.weight"])  # the load must copy
        for kind, source in (("strict", reference), ("loose", other)):
            missing, unexpected, values = got[kind]
            assert (missing, unexpected) == ([], []), (kind, rank)
            assert list(values) == KEYS[rank]
            for name, value in values.items():
                assert torch.equal(value, source[name]), (kind, rank, name)


def test_a_bad_state_dict_is_named_with_the_models_names(loads):
    needs = ["pipeline rank 0 needs for its stage 0 (layer 0's 'embed.weight')",
             "pipeline rank 1 needs for its stage 1 (layer 4's 'head.weight', a tied copy stored under its first "
             "name)"]
    for rank, got in enumerate(loads):
        assert got["missing"].startswith(
            f"the state dict has no entry for 'embed.weight' (shape (16, 8)), which {needs[rank]}: "), got["missing"]
        assert got["foreign"].startswith(
            "the state dict has '0.weight', which this model does not have (it has 12 names, from 'embed.weight', "
            "'block0.0.weight', 'block0.0.bias', ... to 'head.bias')"), got["foreign"]


def test_a_shared_batchnorm_is_refused_naming_its_names(loads):
    for got in loads:
        assert got["refused"].startswith(
            "buffer 'norm.running_mean' = 'block1.running_mean' is used by stages [0, 1] on pipeline ranks [0, 1]: "
            "BatchNorm1d updates it"), got["refused"]


def test_a_checkpoint_stores_and_loads_the_unsplit_models_names(tmp_path):
    path = str(tmp_path / "ckpt")
    got = launch(rt.checkpoint, 2, path, timeout=180, start_method="fork")
    entries = FileSystemReader(path).read_metadata().state_dict_metadata
    model_keys = sorted(name[6:] for name in entries if name.startswith("model."))
    assert model_keys == sorted(n for n in SPEC if n != "head.weight")  # the tie once, under its first name
    optim_keys = sorted(name[6:] for name in entries if name.startswith("optim.state."))
    assert optim_keys == sorted(f"state.{n}.momentum_buffer" for n in PARAMETERS)
    saved = {}
    for rank, out in enumerate(got):
        assert out["step"] == 1 and out["momenta"] is True
        assert list(out["saved"]) == list(out["loaded"]) == KEYS[rank]
        for name, value in out["saved"].items():
            assert torch.equal(out["loaded"][name], value), (rank, name)
        saved.update(out["saved"])
    assert saved["norm.num_batches_tracked"].item() == 2  # two microbatches went through the BatchNorm
    unsplit = rt.model(3)
    assert load_into(unsplit, path).step == 1  # the checkpoint loads into the unsplit model by its own names
    for name, value in unsplit.state_dict().items():
        assert torch.equal(value, saved["embed.weight" if name == "head.weight" else name]), name
