"""A rank's parameters and buffers under the unsplit model's names (FQNs), so state is independent of the split.

The unsplit ``nn.Sequential`` names a layer's tensors ``"<its key>.<name>"``: the model's own keys
(:func:`~pipesched.runtime.stage.layer_names`), ``"3.attn.weight"`` for a plain ``nn.Sequential(*layers)`` (a list
of modules: the index), ``"embed.weight"`` for one built from an ``OrderedDict`` with an ``"embed"`` layer. A rank
holds some layers; :func:`rank_view` registers each under its key in the model, so the view's ``state_dict()`` and
``named_parameters()`` give those same names whatever the number of ranks, virtual stages, balance or schedule
(``Pipeline.layer_names`` holds every layer's key, on every rank).
:func:`saved_state` is the one place that decides which tensors a rank saves (a tied parameter once, by the rank
that owns the tie); :func:`read_plan` says which stored entry fills each tensor on load.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..checks import check_flag


class IncompatibleKeys(NamedTuple):
    """What a non-strict load skipped: names of this rank's tensors the state dict lacks, and names in it that
    the unsplit model does not have (as ``nn.Module.load_state_dict`` returns)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def state_spec(layers, names=None) -> dict[str, tuple[int, ...]]:
    """Every name of the unsplit model's ``state_dict()`` (parameters and persistent buffers) -> its shape, in model
    order; kept by a Pipeline on every rank so that any rank can tell a name or shape of another model. ``names``:
    each layer's key in the model (:func:`~pipesched.runtime.stage.layer_names`; ``None``: its index)."""
    names = _keys(layers, names)
    spec: dict[str, tuple[int, ...]] = {}
    for index, layer in enumerate(layers):
        for name, tensor in layer.state_dict(keep_vars=True).items():
            spec[f"{names[index]}.{name}"] = tuple(tensor.shape)
    return spec


def _keys(layers, names) -> list[str]:
    return [str(i) for i in range(len(layers))] if names is None else list(names)


def rank_view(stages: dict[int, nn.Module], first_layers, names=None) -> nn.Module:
    """An ``nn.Module`` holding this rank's layers, each registered under its key in the model (shared, not
    copied): its ``state_dict()`` and ``named_parameters()`` use the unsplit model's names.

    Args:
        stages: ``{stage: nn.Sequential of its layers}`` of this rank (``Pipeline.stages``).
        first_layers: per stage the index of its first layer in the model, then the layer count
            (``Pipeline.first_layers``).
        names: every layer's key in the model (``Pipeline.layer_names``); ``None``: its index.
    """
    view = nn.Module()
    for stage in sorted(stages):
        for offset, layer in enumerate(stages[stage]):
            index = first_layers[stage] + offset
            view.add_module(str(index) if names is None else names[index], layer)
    return view


def tie_aliases(pipe) -> dict[str, str]:
    """Name of each later use of a tied parameter (:attr:`Pipeline.ties`) -> the name it is stored under: its first
    use's, on the rank of the stage that owns the tie (``{"6.weight": "0.weight"}``)."""
    return {name: tie.names[0] for tie in pipe.ties for name in tie.names[1:]}


def saved_state(pipe) -> dict[str, torch.Tensor]:
    """The tensors this rank saves (a checkpoint, :meth:`Pipeline.state_dict`), by unsplit-model name, in model order:
    every parameter and persistent buffer of its layers (detached, sharing storage, as ``nn.Module.state_dict``), a
    tensor used under several names (a tied parameter, :func:`tie_aliases`, or one shared by two of its layers)
    once, under its stored name: the tie's first name, on every rank holding a copy, so that every rank's dict holds
    every tensor it has (it round-trips through :func:`load_rank_state_dict`) and a checkpoint stores a tie once
    (DCP writes a key that several ranks save once; the copies are identical).

    This is the only function that decides what a rank saves; :func:`read_plan` (what it loads) follows from it.
    """
    plan = pipe_read_plan(pipe)
    position = {name: i for i, name in enumerate(pipe.state_spec)}
    return {stored: plan[stored][0] for stored in sorted(plan, key=lambda name: position.get(name, -1))}


def read_plan(named: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, list[torch.Tensor]]:
    """Stored name -> the tensors to fill from it: each of ``named`` (name -> tensor) under its own name, or under
    ``aliases[name]`` for a later use of a shared tensor, which is stored once under its first name."""
    plan: dict[str, list[torch.Tensor]] = {}
    for name, tensor in named.items():
        plan.setdefault(aliases.get(name, name), []).append(tensor)
    return plan


def pipe_read_plan(pipe) -> dict[str, list[torch.Tensor]]:
    """:func:`read_plan` of this rank's tensors: :func:`saved_state`'s own, and each tied copy from its stored name.
    A tensor this rank's layers use under several names (a tie whose stages are all on this rank, as on 1 rank: no
    :attr:`Pipeline.ties` entry when one stage holds both uses) is stored under its first name too, so a checkpoint
    holds a tie once whatever the rank count, and one saved on 2 ranks loads on 1 and back."""
    return read_plan(_view_state(pipe), pipe_aliases(pipe))


def pipe_aliases(pipe) -> dict[str, str]:
    """Each later name of a parameter this rank stores once -> the name it is stored under: a tied copy's
    (:func:`tie_aliases`) and one this rank's layers share among themselves (:func:`shared_aliases`; the tie of a
    1-rank Pipeline), as every rank count stores it. A buffer several layers share is stored under each of its
    names, as on ranks that hold one use each (buffers are no ties)."""
    view = rank_view(pipe.stages, pipe.first_layers, pipe.layer_names)
    parameters = {name for name, _ in view.named_parameters(remove_duplicate=False)}
    shared = {name: first for name, first in shared_aliases(view).items() if name in parameters}
    return {**shared, **tie_aliases(pipe)}


def shared_aliases(model: nn.Module) -> dict[str, str]:
    """For a plain model: each later name of a tensor that its ``state_dict`` lists under several names (a tied
    weight) -> its first name, under which a checkpoint stores it."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def parameter_names(pipe) -> dict[int, str]:
    """``id(parameter) -> the name its state is stored under`` for this rank's parameters (a parameter used twice:
    its first name in model order; a tied copy: the tie's stored name, so every rank holding it writes and reads one
    entry, which DCP writes once)."""
    view = rank_view(pipe.stages, pipe.first_layers, pipe.layer_names)
    aliases = tie_aliases(pipe)
    return {id(p): aliases.get(name, name) for name, p in view.named_parameters()}


def _view_state(pipe) -> dict[str, torch.Tensor]:
    return dict(rank_view(pipe.stages, pipe.first_layers, pipe.layer_names).state_dict())


def first_mismatch(found: dict[str, tuple[int, ...] | None], local: dict[str, torch.Tensor],
                   spec: dict[str, tuple[int, ...]], source: str, strict: bool = True,
                   needs=None) -> tuple[list, str] | None:
    """The first reason ``found`` (name -> shape, ``None`` for a non-tensor; e.g. a checkpoint's entries) does not
    fit the model, or ``None``.

    Checked in this order, each in model order (``found``'s order for unexpected names): a name of this rank
    (``local``) missing from ``found`` (``strict`` only); a name in ``found`` the unsplit model (``spec``) does not
    have (``strict`` only); a name whose shape differs from the model's. ``source`` names what was read in the
    message (``"the state dict"``, ``"checkpoint '/ckpt/step-000100'"``). ``needs`` (optional, name -> why this
    rank needs it, :func:`needed_by`) explains a missing name instead of calling ``found`` another model's.

    Returns:
        ``([kind, position], message)``: the pair orders the problems several ranks find (the smallest comes
        first: a missing name of the earliest layer), the message names the offending name.
    """
    if strict:
        positions = {name: i for i, name in enumerate(spec)}
        for name, tensor in local.items():
            if name not in found and needs is not None:
                return [0, positions.get(name, -1)], (
                    f"{source} has no entry for '{name}' (shape {tuple(tensor.shape)}), which {needs[name]}: a state "
                    f"dict must hold every tensor of the rank that loads it (the unsplit model's state_dict(), or "
                    f"this rank's own Pipeline.state_dict()); strict=False skips the missing ones")
            if name not in found:
                return [0, positions.get(name, -1)], (
                    f"{source} has no entry for '{name}' (shape {tuple(tensor.shape)}), which this model has: it "
                    f"was saved from another model (strict: every tensor of the model must be there)")
        for i, name in enumerate(found):
            if name not in spec:
                return [1, i], (f"{source} has '{name}', which this model does not have (it has {len(spec)} names, "
                                f"{_sample(spec)}): it was saved from another model (strict: no extra names)")
    for i, (name, shape) in enumerate(found.items()):
        want = spec.get(name)
        if want is not None and (shape is None or tuple(shape) != want):
            got = "a non-tensor" if shape is None else f"shape {tuple(shape)}"
            return [2, i], f"'{name}' has {got} in {source} but shape {want} in this model"
    return None


def rank_state_dict(pipe) -> dict[str, torch.Tensor]:
    """``Pipeline.state_dict()``: :func:`saved_state` (every tensor of this rank, unsplit-model names, sharing
    storage; a tied copy under the tie's first name)."""
    return saved_state(pipe)


def needed_by(pipe) -> dict[str, str]:
    """Stored name -> why this rank needs it, for a load's error message: ``"pipeline rank 3 needs for its stage 3
    (layer 5's '5.weight', a tied copy stored under its first name)"``; a layer keyed ``"head"`` in the model:
    ``layer 5's 'head.weight'``)."""
    aliases = pipe_aliases(pipe)
    stage_of = {pipe.first_layers[s] + i: s for s in pipe.stages for i in range(len(pipe.stages[s]))}
    index_of = {key: i for i, key in enumerate(pipe.layer_names)}
    out: dict[str, str] = {}
    for name in _view_state(pipe):
        stored = aliases.get(name, name)
        if stored in out:
            continue
        layer = index_of[name.partition(".")[0]]
        copy = ", a tied copy stored under its first name" if stored != name else ""
        out[stored] = (f"pipeline rank {pipe.pp_rank} needs for its stage {stage_of.get(layer)} (layer {layer}'s "
                       f"'{name}'{copy})")
    return out


def load_rank_state_dict(pipe, state_dict, strict: bool = True) -> IncompatibleKeys:
    """``Pipeline.load_state_dict()``: copy this rank's entries of ``state_dict`` into its parameters and buffers.

    ``state_dict`` is keyed by unsplit-model names: the unsplit model's ``state_dict()``, or one rank's
    ``Pipeline.state_dict()`` (entries of other ranks' layers are checked, then ignored). Everything is checked
    before anything is copied, so a failed load changes nothing. Values are copied with ``Tensor.copy_``
    (converted to each tensor's dtype and device).

    Returns:
        :class:`IncompatibleKeys`: with ``strict=False``, this rank's names it lacked and names the model lacks.
    Raises:
        TypeError: ``state_dict`` is not a mapping, or an entry is not a tensor (names it); ``strict`` not a bool.
        ValueError: the first offending name (see :func:`first_mismatch`): with ``strict``, a tensor of this rank it
            lacks or a name the unsplit model does not have; always, a shape that differs from the model's.
    """
    check_flag(strict, "strict", where="load_state_dict: ")
    if not hasattr(state_dict, "items"):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict['{name}'] must be a tensor, got {type(value).__name__}")
    plan = pipe_read_plan(pipe)
    found = {name: tuple(value.shape) for name, value in state_dict.items()}
    problem = first_mismatch(found, {n: ts[0] for n, ts in plan.items()}, pipe.state_spec, "the state dict", strict,
                             needed_by(pipe))
    if problem:
        raise ValueError(problem[1])
    last = _last_given(state_dict, pipe_aliases(pipe), pipe.state_spec)
    with torch.no_grad():
        for name, tensors in plan.items():
            for tensor in tensors:
                if name in last:
                    tensor.copy_(state_dict[last[name]])
    return IncompatibleKeys([n for n in plan if n not in state_dict],
                            [n for n in state_dict if n not in pipe.state_spec])


def _last_given(state_dict, aliases: dict, spec) -> dict:
    """Stored name -> the name whose value to load: of a tied parameter's names in ``state_dict``, the last in the
    model's order (what ``nn.Module.load_state_dict`` leaves in a parameter listed under several names, when a
    state dict from an untied source gives them different values); else the name itself."""
    position = {name: i for i, name in enumerate(spec)}
    chosen = {name: name for name in state_dict}
    for alias, stored in aliases.items():
        if alias in state_dict and position.get(alias, -1) >= position.get(chosen.get(stored), -1):
            chosen[stored] = alias
    return chosen


def _sample(spec) -> str:
    names = list(spec)
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return f"from {shown}{', ...' if len(names) > 3 else ''} to '{names[-1]}'" if names else "none"
