"""Bad input the runtime used to take: a model of other widths on one rank (same layer count) passed the
construction agreement and failed only at the first step's message, as a fault that ends the pipeline; now the
ranks agree on the model's tensor names and shapes (``model`` field, :func:`~pipesched.runtime.agreement.model_shapes`)
and every rank raises one ValueError at construction, after which the same ranks build and train a good Pipeline.
``profile_link`` with other ``nbytes``/``repeat`` on one rank aborted the process in gloo (mismatched message
sizes); ranks now all-gather their checked arguments first and raise one ValueError. Flags taken by truthiness
(``load_state_dict(strict="no")``, ``load_into(strict=...)``), ``latest_checkpoint(3)`` (reached ``os.fspath``) and
``stage_activation_bytes(num_stages=0)`` (ZeroDivisionError) are refused, naming the argument and its value.

2 ranks over gloo (launch): Pipeline timeout 60 s, launch timeout 120 s; a regression shows as a step error or a
timeout message the expected strings refuse; nothing here is timed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, latest_checkpoint, launch, load_into, profile_link
from pipesched.runtime.agreement import model_shapes
from pipesched.runtime.stage import layers_of
from pipesched.runtime.state import state_spec

from rt_cases import outcome

pytestmark = pytest.mark.multiprocess


def _model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 8), nn.Tanh())


def body(rank):
    torch.set_num_threads(1)
    out = {"widths": outcome(lambda: Pipeline(_model(8 if rank == 0 else 16), num_microbatches=2,
                                                loss_fn=F.mse_loss, timeout=60))}
    pipe = Pipeline(_model(8), num_microbatches=2, loss_fn=F.mse_loss, timeout=60)  # the same ranks, a good one
    x, y = torch.ones(4, 8), torch.zeros(4, 8)
    out["strict"] = outcome(lambda: pipe.load_state_dict(pipe.state_dict(), strict="no"))
    out["loss"] = float(pipe.step(x, target=y))
    reference = _model(8)
    out["reference"] = float(F.mse_loss(reference(x), y))
    pipe.close()
    # profile_link: ranks with other sizes or repeats (gloo aborted the process), or one rank's bad argument
    out["link repeat"] = outcome(lambda: profile_link(nbytes=(1024, 4096), repeat=2 + rank))
    out["link nbytes"] = outcome(lambda: profile_link(nbytes=(1024, 4096) if rank else (1024, 8192), repeat=2))
    out["link refused"] = outcome(lambda: profile_link(nbytes=(1024, 4096), repeat="x" if rank else 2))
    out["link"] = outcome(lambda: profile_link(nbytes=(1024, 4096), repeat=2))
    return out


def _shapes(width: int) -> str:
    return model_shapes(state_spec(layers_of(_model(width))))


def test_other_widths_on_one_rank_are_refused_at_construction_on_every_rank():
    results = launch(body, 2, timeout=120)
    narrow, wide = _shapes(8), _shapes(16)
    assert narrow.startswith("4 tensors, names and shapes digest ") and narrow != wide
    tail = "; every rank must construct Pipeline with the same arguments (and the same model)"
    first = "; the first difference: '0.weight' has shape {} on world rank {} but {} on world rank {}"
    assert results[0]["widths"] == (f"ValueError: world rank 1 built its Pipeline with model={wide!r} but world rank "
                                    f"0 with model={narrow!r}{first.format((16, 8), 1, (8, 8), 0)}{tail}")
    assert results[1]["widths"] == (f"ValueError: world rank 0 built its Pipeline with model={narrow!r} but world rank "
                                    f"1 with model={wide!r}{first.format((8, 8), 0, (16, 8), 1)}{tail}")
    same = "; every rank of the group must pass the same"
    assert [r["link repeat"] for r in results] == [
        f"ValueError: profile_link: rank 1 passed nbytes=[1024, 4096], repeat=3 but rank 0 nbytes=[1024, 4096], "
        f"repeat=2{same}",
        f"ValueError: profile_link: rank 0 passed nbytes=[1024, 4096], repeat=2 but rank 1 nbytes=[1024, 4096], "
        f"repeat=3{same}"]
    assert results[0]["link nbytes"] == (f"ValueError: profile_link: rank 1 passed nbytes=[1024, 4096], repeat=2 but "
                                         f"rank 0 nbytes=[1024, 8192], repeat=2{same}")
    assert results[0]["link refused"] == ("ValueError: profile_link: rank 1 refused its arguments: repeat must be an "
                                          "int 1..10,000 (round trips per size), got 'x'")
    assert results[1]["link refused"] == "ValueError: repeat must be an int 1..10,000 (round trips per size), got 'x'"
    assert [r["link"] for r in results] == ["ok", "ok"]  # the refusals left nothing in flight
    for r in results:  # refused before any group existed: the next Pipeline of the same ranks trains
        assert r["strict"] == "TypeError: load_state_dict: strict must be True or False, got str 'no'"
        assert r["loss"] == pytest.approx(r["reference"], rel=1e-6)


def test_model_shapes_ignores_values_and_names_count_and_shapes():
    assert _shapes(8) == model_shapes(state_spec(layers_of(_model(8))))
    torch.manual_seed(5)
    other_values = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    assert model_shapes(state_spec(layers_of(other_values))) == _shapes(8)
    assert model_shapes({}).startswith("0 tensors, ")


@pytest.mark.parametrize("value, shown", [(3, "int 3"), (b"ckpt", "bytes b'ckpt'"), (None, "NoneType None")])
def test_latest_checkpoint_refuses_a_directory_that_is_no_path(value, shown):
    with pytest.raises(TypeError) as info:
        latest_checkpoint(value)
    assert str(info.value) == f"latest_checkpoint: directory must be a str or os.PathLike, got {shown}"


def test_load_into_refuses_a_model_or_strict_of_the_wrong_type(tmp_path):
    with pytest.raises(TypeError) as info:
        load_into("model", tmp_path)
    assert str(info.value) == "load_into: model must be an nn.Module (the unsplit model), got str 'model'"
    with pytest.raises(TypeError) as info:
        load_into(_model(8), tmp_path, strict=0)
    assert str(info.value) == "load_into: strict must be True or False, got int 0"


@pytest.mark.parametrize("value, shown", [(0, "0"), (-1, "-1"), (True, "True (a bool is not a count)"), (2.0, "2.0")])
def test_stage_activation_bytes_refuses_a_num_stages_that_is_no_count(value, shown):
    from pipesched import ScheduleArgumentError
    from pipesched.runtime import stage_activation_bytes

    with pytest.raises(ScheduleArgumentError) as info:
        stage_activation_bytes(_model(8), torch.ones(2, 8), value)
    assert str(info.value) == f"num_stages must be an integer >= 1, got {shown}"
    assert set(stage_activation_bytes(_model(8), torch.ones(2, 8), 2)) == {"stash_bytes", "input_bytes",
                                                                           "recompute_bytes"}
