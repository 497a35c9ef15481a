"""Cut an ``nn.Sequential`` (or a list of modules) into contiguous stages and pick this rank's ones."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..checks import as_int
from ..partition import balance_by_time
from ..profile import LayerProfile
from .microbatch import cloned
from .torch_errors import inplace_on_leaf


def layers_of(model) -> list[nn.Module]:
    """The layers of ``model`` in order.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential`` or a list/tuple of ``nn.Module`` (names the bad item).
        ValueError: the container itself does something the split would skip: an ``nn.Sequential`` subclass with a
            ``forward`` of its own, or hooks registered on the container (:func:`refuse_container_behaviour`).
    """
    if isinstance(model, nn.Sequential):
        refuse_container_behaviour(model)
        return list(model)
    if isinstance(model, (list, tuple, nn.ModuleList)):
        for i, layer in enumerate(model):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"model[{i}] must be an nn.Module, got {type(layer).__name__}")
        return list(model)
    raise TypeError(f"model must be an nn.Sequential or a list of nn.Module, got {type(model).__name__}")


def layer_names(model) -> list[str]:
    """The name of each layer of ``model`` (in :func:`layers_of`'s order) in the unsplit model's ``state_dict()``:
    its key in an ``nn.Sequential`` (``"0"``, ``"1"``, ... or, built from an ``OrderedDict``, ``"embed"``), its
    index for a list, tuple or ``nn.ModuleList``. Layer ``i``'s tensors are named ``f"{names[i]}.<name>"``; a key
    never holds a dot (``nn.Module`` refuses one), so a tensor's name up to its first dot is its layer's.

    Raises:
        TypeError: as :func:`layers_of`.
    """
    layers = layers_of(model)
    if isinstance(model, nn.Sequential):
        return list(model._modules)
    return [str(i) for i in range(len(layers))]


_CONTAINER_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                    ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))


def refuse_container_behaviour(model: nn.Sequential) -> None:
    """Refuse an ``nn.Sequential`` whose container adds to running its layers in order: the stages are new
    ``nn.Sequential`` objects holding the layers (its children), so a ``forward`` of a subclass (``x * 2`` before the
    layers) or a hook on the container itself would silently not run, and the loss and gradients would differ from
    the unsplit model's. Hooks on the layers run as in the unsplit model.

    Raises:
        ValueError: names the class or the hooks and what to do instead.
    """
    kind = type(model)
    if kind.forward is not nn.Sequential.forward:
        raise ValueError(f"model is a {kind.__qualname__}, an nn.Sequential subclass with a forward() of its own: a "
                         f"Pipeline runs the model's layers (its children) in order, one stage after another, so "
                         f"what {kind.__qualname__}.forward adds would silently not run; move that code into a layer "
                         f"(an nn.Module among its children), or pass nn.Sequential(*model) if it adds nothing")
    hooks = [f"{len(getattr(model, attr))} {what}{'s' if len(getattr(model, attr)) > 1 else ''}"
             for attr, what in _CONTAINER_HOOKS if getattr(model, attr, None)]
    if hooks:
        raise ValueError(f"model has {' and '.join(hooks)} registered on the nn.Sequential itself: a Pipeline runs "
                         f"its layers in new stage containers, so these would silently not run; register them on a "
                         f"layer instead (a forward pre-hook on model[0], a forward or backward hook on model[-1])")


def resolve_balance(layers: Sequence[nn.Module], num_stages: int, balance=None, profile=None,
                    stage_to_rank: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage.

    Args:
        layers: the model's layers, in order.
        num_stages: stages to cut into (pipeline ranks x virtual stages).
        balance: ``None`` or ``"layers"`` (even by layer count, larger stages first; the demo's word for it),
            ``"params"`` (contiguous split that
            minimises the largest stage's parameter count), ``"time"`` (the split that minimises the slowest
            rank's forward + backward seconds in ``profile``, then its activation bytes:
            :func:`pipesched.partition.balance_by_time`) or a sequence of ``num_stages`` positive ints summing
            to ``len(layers)``.
        profile: the :class:`~pipesched.profile.LayerProfile` of this model, for ``balance="time"``.
        stage_to_rank: the rank of each stage (the program's placement), for ``balance="time"``; ``None``: one
            stage per rank.
    Raises:
        ValueError: fewer layers than stages, or a balance of the wrong length, with a count < 1, or whose
            sum differs from the layer count (names the layer count and the sum); ``balance="time"`` without a
            profile, or with a profile of another model (layer count or class names differ); a ``profile`` with
            another ``balance`` (it would be ignored).
        TypeError: ``balance`` is of an unknown kind, ``profile`` not a LayerProfile.
    """
    n = len(layers)
    if n < num_stages:
        raise ValueError(f"the model has {n} layer{'' if n == 1 else 's'} but the pipeline needs {num_stages} stages "
                         f"(ranks x virtual_stages); every stage needs at least one layer: give the model at "
                         f"least {num_stages} layers (split a layer in two, or add layers)"
                         + (f", or use fewer ranks or virtual stages, so that ranks x virtual_stages <= {n}"
                            if n else ""))
    if profile is not None and not (isinstance(balance, str) and balance == "time"):  # (a numpy array: no ==)
        raise ValueError(f"profile= is used only with balance='time' (the cut it decides), got balance={balance!r}: "
                         f"pass balance='time', or drop profile=")
    if balance is None or (isinstance(balance, str) and balance == "layers"):
        base, extra = divmod(n, num_stages)
        return tuple(base + 1 if i < extra else base for i in range(num_stages))
    if isinstance(balance, str):
        if balance == "time":
            return _balance_by_time(layers, num_stages, profile, stage_to_rank)
        if balance != "params":
            raise ValueError(f"balance={balance!r}: valid values are None (or 'layers'), 'params' or a list of layer "
                             f"counts (or 'time' with profile=)")
        costs = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        return min_max_partition(costs, num_stages)
    # a list, tuple or 1-d numpy array of integers (numpy integers accepted; plain ints from here on)
    counts = [as_int(b) for b in balance] \
        if isinstance(balance, Sequence) or getattr(balance, "ndim", None) == 1 else [None]
    if None in counts:
        raise TypeError(f"balance must be None, 'params', 'time' or a list of ints, got {balance!r}")
    balance = counts
    if len(balance) != num_stages:
        raise ValueError(f"balance has {len(balance)} entries but the pipeline has {num_stages} stages")
    if any(b < 1 for b in balance):
        raise ValueError(f"balance={list(balance)}: every stage needs at least one layer")
    if sum(balance) != n:
        raise ValueError(f"balance={list(balance)} sums to {sum(balance)} but the model has {n} layers")
    return tuple(balance)


def _balance_by_time(layers, num_stages, profile, stage_to_rank) -> tuple[int, ...]:
    if profile is None:
        raise ValueError("balance='time' needs profile=: the model's LayerProfile, measured once with "
                         "pipesched.runtime.profile_layers(model, sample_microbatch, target, loss_fn) (save it with "
                         "profile.save(path), read it with LayerProfile.load(path))")
    if not isinstance(profile, LayerProfile):
        raise TypeError(f"profile must be a pipesched.LayerProfile, got {type(profile).__name__}")
    profile.check_model(len(layers), [type(layer).__name__ for layer in layers])
    return balance_by_time(profile.layer_seconds(), num_stages, stage_to_rank, memory=profile.activation_bytes)


def min_max_partition(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimising the largest part's sum; ties
    go to the split with earlier cuts (:func:`pipesched.partition.balance_by_time`, one stage per rank)."""
    return balance_by_time(costs, num_stages)


def layer_starts(balance: Sequence[int]) -> list[int]:
    """Per stage, the index in the model of its first layer, then the layer count: ``[2, 3] -> [0, 2, 5]``."""
    starts = [0]
    for count in balance:
        starts.append(starts[-1] + count)
    return starts


def stage_of_each_layer(balance: Sequence[int]):
    """``(stage, index in the model)`` of every layer, in model order: ``[2, 1] -> (0, 0), (0, 1), (1, 2)``."""
    starts = layer_starts(balance)
    return ((stage, index) for stage in range(len(balance)) for index in range(starts[stage], starts[stage + 1]))


def build_stages(layers: Sequence[nn.Module], balance: Sequence[int], stage_ids: Sequence[int]) -> dict[int, nn.Sequential]:
    """``{stage: nn.Sequential of its layers}`` for the requested stages; the layers are shared, not copied."""
    starts = layer_starts(balance)
    return {s: (ClonedInputStage if s > 0 and inplace_first(layers[starts[s]]) else nn.Sequential)(
        *layers[starts[s]:starts[s + 1]]) for s in stage_ids}


def inplace_first(layer: nn.Module) -> bool:
    """Whether ``layer`` (or, for an ``nn.Sequential``, its first layer, nested ones looked into) is a module with
    ``inplace=True`` (``nn.ReLU``, ``nn.Dropout``, ``nn.Hardtanh``, ... take that argument): it writes its
    input in place."""
    while isinstance(layer, nn.Sequential) and len(layer):
        layer = layer[0]
    return getattr(layer, "inplace", False) is True


class ClonedInputStage(nn.Sequential):
    """A stage (after the first) whose first layer has ``inplace=True``: it runs on a clone of its input. A
    received input is a leaf that needs a gradient (autograd refuses an in-place write to it), and a previous
    stage's output on this rank is still saved for that stage's backward; the clone is neither, and its
    backward passes the gradient through unchanged, so gradients equal the unsplit model's bitwise. Costs
    one copy of the input per forward. Same layers, indices and ``state_dict`` keys as ``nn.Sequential``."""

    def forward(self, input):
        return super().forward(cloned(input))


def stage_device(stages, device) -> torch.device:
    """``device`` if given, else that of the stages' first parameter or buffer, else the CPU."""
    if device is not None:
        return torch.device(device)
    for module in stages.values():
        for tensor in list(module.parameters()) + list(module.buffers()):
            return tensor.device
    return torch.device("cpu")


def call_stage(module, arg, stage: int):
    """``module(arg)``, explaining the one failure a pipeline adds: a stage's input is a leaf tensor that needs
    a gradient, so an in-place write to it is refused by autograd although the same layer works inside the
    unsplit model. A first layer with ``inplace=True`` is not such a case (:class:`ClonedInputStage`, or a copy
    made here where ``inplace`` was set after construction); any other in-place write to the input (``x.relu_()``
    in a custom layer's forward) is."""
    if stage > 0 and not isinstance(module, ClonedInputStage) and inplace_first(module):
        arg = cloned(arg)
    try:
        return module(arg)
    except RuntimeError as exc:
        if not inplace_on_leaf(exc):
            raise
        raise ValueError(f"stage {stage} modifies its input in place (e.g. x.relu_() or x.add_(...) in its first "
                         f"layer's forward; a first layer with inplace=True, such as nn.ReLU(inplace=True), is "
                         f"supported: it gets a copy); a stage's input is a leaf tensor that needs a gradient, "
                         f"which autograd does not allow to change in place: make that operation out-of-place, or "
                         f"end stage {stage - 1} with that layer (balance=...)") from exc
