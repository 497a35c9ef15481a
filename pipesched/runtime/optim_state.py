"""Optimizer state keyed by the unsplit model's parameter names, flat, so it reshards across pipeline layouts.

The layout is that of ``torch.distributed.checkpoint.state_dict``'s ``flatten_optimizer_state_dict=True`` (made
for pipeline parallelism): ``"state.<fqn>.<name>"`` (``"state.3.weight.exp_avg"``; nested state joined with
dots) and ``"param_groups.<fqn>.<key>"`` (``"param_groups.3.weight.lr"``). It is built here from
``optimizer.state_dict()`` directly because torch's ``get_optimizer_state_dict`` first runs a zero-lr
``optimizer.step()`` on an optimizer without state (AdamW's step count becomes 1: a save before the first step
would change training), and its ``set_optimizer_state_dict`` silently loads no state into such an optimizer
whose parameters have gradients.
"""
from __future__ import annotations

import torch


def check_owned(optimizer, names: dict[int, str]) -> None:
    """Raise ``ValueError`` if ``optimizer`` holds a parameter that is not one of this rank's (``names``)."""
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise ValueError(f"optimizer param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) is not a "
                                 f"parameter of this rank's stages: build the optimizer from pipe.parameters()")


def flat_state(optimizer, names: dict[int, str]) -> dict[str, object]:
    """``optimizer.state_dict()`` flattened and keyed by parameter name (see the module docstring); the values are
    the optimizer's own tensors (not copies) and hyperparameters."""
    native = optimizer.state_dict()
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    flat: dict[str, object] = {}
    for index, state in native["state"].items():
        _flatten(state, f"state.{order[index]}", flat)
    for group in native["param_groups"]:
        for index in group["params"]:
            for key, value in group.items():
                if key != "params":
                    flat[f"param_groups.{order[index]}.{key}"] = value
    return flat


def wanted_keys(optimizer, names: dict[int, str], available) -> tuple[list[str], str | None]:
    """The flat keys of ``available`` (a checkpoint's, without the ``"optim."`` prefix) this rank's optimizer
    loads, and the first problem (or ``None``): a hyperparameter of one of its groups missing for a parameter (a
    checkpoint of another optimizer, or without this parameter)."""
    keys: list[str] = []
    available = list(available)
    present = set(available)
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = names[id(param)]
            for key in group:
                if key != "params" and f"param_groups.{fqn}.{key}" not in present:
                    return [], (f"has no optimizer hyperparameter '{key}' for parameter '{fqn}' (it was saved with "
                                f"another optimizer, or without this parameter)")
            keys += [f"param_groups.{fqn}.{key}" for key in group if key != "params"]
            prefix = f"state.{fqn}."
            keys += [k for k in available if k.startswith(prefix)]
    return keys, None


def load_flat_state(optimizer, names: dict[int, str], flat: dict[str, object]) -> None:
    """Load ``flat`` (this rank's keys, as :func:`wanted_keys` chose them) with ``optimizer.load_state_dict``,
    which moves each state tensor to its parameter's device (and floating ones to its dtype, except ``step``)."""
    state: dict[int, dict] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        first = names[id(group["params"][0])] if group["params"] else None
        native = {key: flat[f"param_groups.{first}.{key}"] for key in group if key != "params" and first}
        native["params"] = []
        for param in group["params"]:
            fqn = names[id(param)]
            entry = _unflatten({k[len(f"state.{fqn}."):]: v for k, v in flat.items() if k.startswith(f"state.{fqn}.")})
            if entry:
                state[index] = _laid_out_as(entry, param)
            native["params"].append(index)
            index += 1
        groups.append(native)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _laid_out_as(entry: dict, param) -> dict:
    """``entry``'s tensors of ``param``'s shape laid out as ``param`` (a channels_last conv weight's ``exp_avg``), as
    torch's own state is (``zeros_like(param)``); the checkpoint is read into row-major tensors. Values unchanged."""
    if param.layout != torch.strided:
        return entry
    return {k: torch.empty_like(param, dtype=v.dtype, device=v.device).copy_(v)
            if isinstance(v, torch.Tensor) and v.shape == param.shape and v.stride() != param.stride() else v
            for k, v in entry.items()}


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(inner, f"{prefix}.{key}", out)
    else:
        out[prefix] = value


def _unflatten(flat: dict[str, object]) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested
