"""What a stage (or the loss) received, in words, for the error of a forward that raised: shape and dtype
surprises between stages are the common cause, and the exception alone (``mat1 and mat2 shapes cannot be
multiplied``) does not say which tensor came from where. Made only while an exception is handled (never on the
hot path), and never raises: a description that fails is left out."""
from __future__ import annotations

import torch

from .microbatch import as_value

#: the elements of a tuple (list, dict) named before "... (N tensors)"
SHOWN = 3


def value_text(value, depth: int = 0) -> str:
    """``tensor (3, 16) float32``; a tuple ``tuple (tensor ..., tensor ...)``, a long one its first ``SHOWN``
    elements then ``... (N tensors)`` (``N items`` where not all are tensors); a dict by key; anything else by its
    type."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if value is None:
        return "None"
    if isinstance(value, (tuple, list, dict)):
        kind = type(value).__name__
        if depth >= 2:
            return f"{kind} of {len(value)}"
        keyed = isinstance(value, dict)
        items = list(value.items()) if keyed else list(enumerate(value))
        parts = [f"{k!r}: {value_text(v, depth + 1)}" if keyed else value_text(v, depth + 1) for k, v in items[:SHOWN]]
        if len(items) > SHOWN:
            tensors = all(isinstance(v, torch.Tensor) for _, v in items)
            parts.append(f"... ({len(items)} {'tensors' if tensors else 'items'})")
        return f"{kind} ({', '.join(parts)})"
    return type(value).__name__


def stage_input_text(stage: int, microbatch: int, inputs, container: int, from_rank: int | None) -> str | None:
    """``its input (from stage 0 on pipeline rank 0): tensor (3, 16) float16``; stage 0's: ``its input (the
    step's x, microbatch 0): ...``. ``inputs``: the tuple of tensors the executor holds, passed as one tensor
    unless ``container``. ``None`` where it cannot be described."""
    try:
        source = (f"the step's x, microbatch {microbatch}" if stage == 0
                  else f"from stage {stage - 1} on pipeline rank {from_rank}")
        return f"its input ({source}): {value_text(as_value(tuple(inputs), container))}"
    except Exception:  # noqa: BLE001 - describing must never hide the original error
        return None


def loss_input_text(output, target) -> str | None:
    """``loss_fn got output tensor (3, 16) float32 and target tensor (3, 8) float32`` (``and no target`` where
    the step has none); ``None`` where it cannot be described."""
    try:
        return (f"loss_fn got output {value_text(output)} and "
                + ("no target" if target is None else f"target {value_text(target)}"))
    except Exception:  # noqa: BLE001 - describing must never hide the original error
        return None
