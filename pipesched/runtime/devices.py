"""Where a rank's stages run, and moving a step's inputs there.

A device the pipeline cannot run on, a stage tensor off that device, or an input that cannot be moved to it
is a ``ValueError`` naming the argument (``device``, ``x``, ``target``) and both devices: at construction
for the stages (before any communication), and for an input on the rank that checks it, before any work
(the other ranks raise the same error, see :mod:`pipesched.runtime.handshake`).
"""
from __future__ import annotations

import torch

from .stage import stage_device

SUPPORTED = ("cpu", "cuda")  # gloo on CPU, NCCL on CUDA


def checked_device(stages: dict, device=None) -> torch.device:
    """The device this rank's ``stages`` run on (``device``, else that of their first parameter or buffer,
    else the CPU), checked: a CPU or an available CUDA device (``"cuda"`` without an index is made the current
    CUDA device, as ``torch`` places tensors there), holding every parameter and buffer of the stages.

    Raises:
        ValueError: ``device`` is not a device; the device is neither CPU nor CUDA (e.g. ``meta``: it holds no
            data to compute with or send); CUDA is not available or has no such index; a parameter or buffer of
            a stage is on another device (names the stage, the tensor, its layer's class and both devices).
    """
    try:
        chosen = stage_device(stages, device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None
    where = (f"device={device!r}" if device is not None else
             f"device=None: the stages' device is that of their first tensor, {_first_tensor(stages)}, on {chosen}")
    if chosen.type not in SUPPORTED:
        raise ValueError(f"{where}, but a pipeline runs its stages on cpu (gloo) or cuda (NCCL), not on "
                         f"{chosen.type}" + (" (a meta tensor holds no data to compute with or send; materialize "
                                             "the model first, e.g. model.to_empty(device='cpu') and initialize it)"
                                             if chosen.type == "meta" else ""))
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{where}, but CUDA is not available in this process (torch.cuda.is_available() is "
                             f"False); run the stages on cpu")
        if chosen.index is None:
            chosen = torch.device("cuda", torch.cuda.current_device())
        elif chosen.index >= torch.cuda.device_count():
            raise ValueError(f"{where}, but this process sees {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    for stage, name, tensor, owner in _tensors(stages):
        if tensor.device != chosen:
            if tensor.device.type == "meta":
                fix = f"materialize the model there first (model.to_empty(device={str(chosen)!r}), then initialize it)"
            elif device is None:
                fix = "put every layer of this rank's stages on one device"
            else:
                fix = f"move the model there first (model.to({str(chosen)!r})) or pass device={str(tensor.device)!r}"
            raise ValueError(f"{where}, but stage {stage}'s {name} ({owner}) is on {tensor.device}; {fix}")
    return chosen


def move_to(batch, device: torch.device, name: str):
    """``batch`` (a tensor, or a tuple or list of them) with its tensors on ``device``; anything else is left
    as it is, for :func:`~pipesched.runtime.microbatch.split` to name.

    Raises:
        ValueError: a tensor cannot be moved there (e.g. it is on ``meta``, which holds no data); names it
            (``x``, ``x[1]``, ``target``), its device and ``device``.
    """
    if isinstance(batch, torch.Tensor):
        return _move(batch, device, name)
    if isinstance(batch, (tuple, list)):
        moved = [_move(t, device, f"{name}[{i}]") if isinstance(t, torch.Tensor) else t for i, t in enumerate(batch)]
        return moved if isinstance(batch, list) else tuple(moved)  # a list stays a list (what the model gets)
    return batch


def _move(tensor: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if tensor.device.type == "meta":
        where = "" if device.type == "cpu" else " or the CPU"
        raise ValueError(f"{name} is on the meta device, which holds no data, and cannot be moved to the stages' "
                         f"device {device}; pass {name} with its values (on {device}{where})")
    try:
        return tensor.to(device)
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"{name} is on {tensor.device} and cannot be moved to the stages' device {device}: "
                         f"{exc}") from None


def _tensors(stages: dict):
    """``(stage, "parameter 0.weight", tensor, "Linear")`` for every parameter and buffer of the stages."""
    for stage, module in stages.items():
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for qualified, tensor in named:
                layer = module.get_submodule(qualified.rpartition(".")[0])
                yield stage, f"{kind} {qualified}", tensor, type(layer).__name__


def _first_tensor(stages: dict) -> str:
    for stage, name, _, owner in _tensors(stages):
        return f"stage {stage}'s {name} ({owner})"
    return "none (no parameters or buffers)"
