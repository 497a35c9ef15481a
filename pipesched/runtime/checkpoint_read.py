"""Reading a pipesched checkpoint directory (:mod:`~pipesched.runtime.checkpoint`'s format): its metadata and format
tag, the buffers this rank reads into, copying what was read into the model's tensors, and the names of the hidden
directories a save uses."""
from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import rng_state
from .optim_state import check_owned, wanted_keys
from .state import parameter_names

FORMAT = "pipesched-checkpoint/1"
SAVING, REPLACED = ".saving", ".replaced"  # suffixes of a save's hidden temporary directories


def _held_checkpoints(folder: str) -> str:
    """For a folder that is no checkpoint: the checkpoints it holds, as a hint (``""`` if none)."""
    try:
        names = sorted(n for n in os.listdir(folder) if not n.startswith(".")
                       and os.path.isfile(os.path.join(folder, n, ".metadata")))
    except OSError:
        return ""
    if not names:
        return ""
    shown = ", ".join(repr(n) for n in names[-3:])
    return (f"; it is a folder of {len(names)} checkpoint(s) ({'..., ' if len(names) > 3 else ''}{shown}): load one "
            f"of them, e.g. load_checkpoint(latest_checkpoint({folder!r}))")


def read_checkpoint(path) -> tuple[str, dict, dict]:
    """(absolute path, DCP entries by name, the ``pipesched.*`` values) of a complete pipesched checkpoint."""
    target = as_path(path)
    if not os.path.lexists(target):
        raise FileNotFoundError(f"checkpoint {target!r} does not exist")
    name = os.path.basename(target)
    if name.startswith(".") and name.endswith((SAVING, REPLACED)):
        raise ValueError(f"checkpoint {target!r} is the temporary directory of a save that did not finish; load the "
                         f"checkpoint it was saved as, or latest_checkpoint() of its folder")
    if not os.path.isdir(target) or not os.path.isfile(os.path.join(target, ".metadata")):
        raise ValueError(f"checkpoint {target!r} is incomplete or not a checkpoint: it has no .metadata (written "
                         f"last, when every rank has finished){_held_checkpoints(target)}")
    try:
        entries = FileSystemReader(target).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a damaged file: name the path
        raise ValueError(f"checkpoint {target!r} has an unreadable .metadata: {type(exc).__name__}: {exc}") from None
    if "pipesched.format" not in entries:
        raise ValueError(f"checkpoint {target!r} is not a pipesched checkpoint (a DCP checkpoint without "
                         f"'pipesched.format'); load_into() reads model.* entries only of pipesched checkpoints")
    meta = {name[10:]: None for name in entries if name.startswith("pipesched.")}
    read_locally({"pipesched": meta}, target)
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {target!r} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
    return target, entries, meta


def optimizer_keys(optimizer, pipe, entries: dict, target: str) -> list[str]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    names = parameter_names(pipe)
    check_owned(optimizer, names)
    available = [name[6:] for name in entries if name.startswith("optim.")]
    if not available:
        raise ValueError(f"checkpoint {target!r} has no optimizer state (it was saved without optimizer=); "
                         f"load it with optimizer=None")
    keys, problem = wanted_keys(optimizer, names, available)
    if problem:
        raise ValueError(f"checkpoint {target!r} {problem}")
    return keys


def staging_for(entries: dict, plan: dict, optim_keys, rng_rank: int | None, device) -> dict:
    """New buffers for everything this rank reads (DCP reads into the tensors it is given; objects replace None)."""
    staging: dict = {"model": {name: empty_for(entries[f"model.{name}"]) for name in plan}}
    staging["optim"] = {key: empty_for(entries[f"optim.{key}"]) for key in optim_keys}
    extras = [name[6:] for name in entries if name.startswith("extra.")]
    staging["extra"] = {name: empty_for(entries[f"extra.{name}"]) for name in extras}
    if rng_rank is not None:
        available = [name.split(".")[-1] for name in entries if name.startswith(f"rng.{rng_rank}.")]
        staging["rng"] = {str(rng_rank): rng_state.placeholders(device, available)}
    return staging


def read_locally(state: dict, target: str) -> None:
    """``dcp.load`` in this process only (no collective), without DCP's warning that it assumes so.

    Raises:
        RuntimeError: a read failed (naming the checkpoint and the error). DCP raises a ``CheckpointException``, a
            ``BaseException`` that ``load_checkpoint``'s vote would not catch: the other ranks would wait in it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=target, no_dist=True)
    except CheckpointException as exc:
        why = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values())
        raise RuntimeError(f"checkpoint {target!r}: reading its pipesched entries failed: {why}") from exc


def firsts(plan: dict) -> dict:
    return {name: tensors[0] for name, tensors in plan.items()}


def copy_in(plan: dict, read: dict) -> None:
    """Copy each entry read into every tensor it fills (``Tensor.copy_``: to the tensor's dtype and device)."""
    with torch.no_grad():
        for name, tensors in plan.items():
            for tensor in tensors:
                tensor.copy_(read[name])


def extra_of(meta: dict, staging: dict):
    extra = json.loads(meta.get("extra") or "null")
    tensors = staging.get("extra", {})
    if tensors:
        extra = dict(extra or {})
        extra.update(tensors)
    return extra


def empty_for(md):
    """A CPU tensor to read a tensor entry into, or ``None`` for an object entry."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def shape_of(md):
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def hidden(target: str, suffix: str) -> str:
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}{suffix}")


def as_path(path) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"path must be a non-empty str or os.PathLike, got {path!r}")
    return os.path.abspath(os.fspath(path))
