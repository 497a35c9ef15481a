"""Hunt (s14) for what the runtime holds from construction that a change the user makes between steps leaves stale
(bodies in rt_stale_hunt_s14.py).

Found: the Executor kept the stages' Parameter objects from construction (what each ALL_REDUCE averages, the
TieReducer's tied copies), so a parameter the user *replaced* after construction (a new ``nn.Parameter`` assigned
to a layer, ``model.load_state_dict(sd, assign=True)``, a tie re-made with a new Parameter) was never all-reduced
over the data-parallel replicas, nor summed over its tied copies: the replicas' (copies') gradients silently
differed from each other and from the unsplit model's (0.40-0.96 relative on DP x PP = 2 x 2). A layer replaced in
the model (``model[1] = nn.Linear(...)``) silently did not run: the stages hold the old one. Now ``step()`` refuses
either on every rank, naming it and saying what to do (``runtime/built.py``), and the pipeline stays usable: with
the Parameters of construction back, holding the new values, the step gives the unsplit model's gradients.

Also found: ``pipe.loss_fn`` (a public attribute, read by step()'s own check) reassigned between steps was ignored by
the executor, which kept the constructor's: the old loss was returned and backpropagated (0.9506, mse, where the
unsplit l1 loss is 0.8202). Now each step uses the attribute."""
import pytest
import torch

from pipesched.runtime import launch

import rt_stale_hunt_s14 as S

RTOL = 1e-6
REPLACED = "is not the one this Pipeline was built with: it was replaced after construction"
REMEDY = "copy new values in place (with torch.no_grad(): p.copy_(new), or load_state_dict without assign=True)"


def _close(a, b):
    return torch.allclose(a, b, rtol=RTOL, atol=RTOL * float(b.abs().max()))


@pytest.mark.parametrize("how", ["none", "attr", "assign"])  # none: the control, nothing replaced
def test_a_parameter_replaced_between_steps_is_refused_on_every_rank_and_a_restore_averages_again(how):
    res = launch(S.replaced_dp, 4, how, timeout=240)  # world rank g: pipeline rank g % 2 of replica g // 2
    for rank in range(4):
        text, grads = res[rank]
        if how == "none":
            assert text is None
        else:
            assert REPLACED in text and REMEDY in text, text
            # "attr" replaced stage 1's weight only (pipeline rank 0 says rank 1 refused); "assign" every parameter:
            # every rank raises the first refusing rank's
            named = "parameter '1.weight' (stage 1)" if how == "attr" else "parameter '0.weight' (stage 0)"
            assert named in text, text
        for name, (got, want) in grads.items():
            other = res[(rank + 2) % 4][1][name][0]  # the same pipeline rank of the other replica
            assert torch.equal(got, other), (how, rank, name, "replicas differ", got, other)
            assert _close(got, want), (how, rank, name, "expected the unsplit model's gradient", got, want)


def test_a_tie_remade_with_a_new_parameter_is_refused_and_a_restore_sums_its_copies():
    res = launch(S.retied, 2, timeout=240)
    (t0, g0, want), (t1, g1, _) = res
    for text in (t0, t1):
        assert REPLACED in text, text
    assert torch.equal(g0, g1), ("the tied copies' gradients differ", g0, g1)
    assert _close(g0, want), ("expected the unsplit model's gradient (both uses summed)", g0, want)


def test_a_layer_replaced_in_the_model_is_refused_on_every_rank():
    for rank, (text, same_loss) in enumerate(launch(S.layer_replaced, 2, timeout=240)):
        assert text is not None, rank
        assert "layer '1' (stage 1) of the model is not the one this Pipeline was built with" in text, (rank, text)
        assert same_loss, rank  # the layer of construction back (new values copied in): the unsplit model's loss


def test_a_loss_fn_reassigned_between_steps_is_the_one_used():
    """``pipe.loss_fn`` reassigned: step 2 returns the new loss_fn's loss and gradients, bitwise."""
    for rank, (loss, want, grads) in enumerate(launch(S.loss_fn_reassigned, 2, timeout=240)):
        assert torch.equal(loss, want.reshape(())), (rank, loss, "expected the unsplit l1 loss", want)
        assert len(grads) == 2  # this rank's weight and bias
        for name, (got, ref) in grads.items():
            assert torch.equal(got, ref), (rank, name, got, ref)


def _built():
    from torch import nn

    from pipesched.runtime.built import Built
    from pipesched.runtime.stage import build_stages, layers_of

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    stages = build_stages(layers_of(model), [2, 1], range(2))
    return model, Built(model, stages, [0, 2, 3])


def test_built_names_each_kind_of_change_and_is_quiet_once_restored():
    from torch import nn
    from torch.nn.utils import parametrize

    model, built = _built()
    assert built.changed() is None
    old = model[1][0].weight
    model[1][0].weight = nn.Parameter(old.detach().clone())
    assert built.changed().startswith(f"parameter '1.0.weight' (stage 0) {REPLACED}")
    model[1][0].weight = old
    assert built.changed() is None
    model[1].add_module("adapter", nn.Linear(4, 4))  # a new layer inside a layer (e.g. a LoRA adapter)
    assert built.changed().startswith("parameter '1.adapter.weight' (stage 0) was added after this Pipeline")
    del model[1].adapter
    assert built.changed() is None
    parametrize.register_parametrization(model[2], "weight", nn.Identity())  # weight moves into a ModuleDict
    assert "2.parametrizations.weight.original" in dict(model.named_parameters())
    assert built.changed() is None  # the same Parameter object under another name: the sums hold it still
    parametrize.remove_parametrizations(model[2], "weight")  # the original Parameter back (after the bias now)
    assert built.changed() is None  # the same objects under the same names: their order does not matter
    model[1].add_module("act", nn.Tanh())  # a parameter-free child: nothing the Pipeline holds changes
    assert built.changed() is None
    model[1].act = nn.Tanh()
    assert built.changed() is None
    del model[2].bias
    assert built.changed().startswith("parameter '2.bias' (stage 1) was removed after this Pipeline was built")
    from pipesched.runtime.built import Built
    from pipesched.runtime.stage import build_stages, layers_of

    model, built = _built()
    mine = Built(model, {0: build_stages(layers_of(model), [1, 2], [0])[0]}, [0, 1, 3])  # a rank holding layer 0
    model[1] = nn.Identity()  # a rank may drop layers it does not hold (to free their memory): only theirs refuse
    assert mine.changed() is None and built.changed().startswith("layer '1' (stage 0) of the model")
    model, built = _built()
    kept = model[2]
    model[2] = nn.Linear(4, 4)
    assert built.changed().startswith("layer '2' (stage 1) of the model is not the one this Pipeline was built with")
    model[2] = kept
    model.append(nn.ReLU())
    assert built.changed().startswith("the model has 4 layers, was built from 3")
