"""What a ``loss_fn`` asks of its caller."""
from __future__ import annotations

import inspect

import torch


def needs_target(loss_fn) -> bool:
    """Whether ``loss_fn`` requires a second positional argument, the target (``False`` if its signature is
    unknown)."""
    try:
        fn = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]
    return len(required) >= 2
