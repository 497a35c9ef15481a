"""What a ``loss_fn`` asks of its caller, and what a step makes of what it returns (checked, weighted, summed)."""
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


#: the dtypes a loss may have: its value travels to the other ranks exactly, as a float64
LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def checked_loss(value):
    """``value``, what ``loss_fn`` returned for one microbatch, if it is a one-element floating-point tensor.

    Raises:
        ValueError: it is not a tensor, has more or fewer than one element, or is not of :data:`LOSS_DTYPES`.
    """
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (one element: shape (), (1,), ...), got {shape}")
    if value.dtype not in LOSS_DTYPES:
        raise ValueError(f"loss_fn must return a floating-point tensor ({', '.join(map(str, LOSS_DTYPES))}), "
                         f"got {value.dtype}")
    return value


def weighted(value, weight: float, grad_weight: float):
    """``(returned term, backward's term)`` of one microbatch's loss ``value``: ``value * n / N`` for the step loss,
    and ``value * n * dp / N_all`` for its backward (the same tensor where every replica got the same batch size),
    so that the data-parallel average is the whole batch's gradient."""
    own = value * weight
    return own, (own if grad_weight == weight else value * grad_weight)


def step_total(losses: dict, m: int):
    """The step loss from the microbatches' returned terms ``{mb: 0-dim or one-element tensor}``: summed in
    microbatch order (as the other ranks receive it), 0-dim, of the loss dtype."""
    total = losses[0]
    for mb in range(1, m):
        total = total + losses[mb]
    return total.reshape(())
