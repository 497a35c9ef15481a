"""One asynchronous gradient sum over a process group that keeps ``.grad is None`` right: the data-parallel
``ALL_REDUCE`` of a stage and the ``TIE_REDUCE`` of a tie both use it.

Every member flattens the same parameters, in the same order, whatever their ``.grad`` is on that rank: a tensor,
or ``None`` sent as zeros. One presence flag per parameter (an extra element: 1 when this copy has a gradient, 0
when not) travels in the same flat buffer. So the sum is over the same elements on every member even when one
replica's data left a parameter unused (without the flags the flat buffers would differ in length across members),
and a parameter no member had a gradient for keeps ``.grad`` None, as the unsplit model's would (an optimizer then
skips it, weight decay included), while one that any member had a gradient for gets the sum on every member.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .failure import CommError
from .transport import wait


class PendingSum(NamedTuple):
    """A started sum: its work handle, the flat buffer it sums into, the parameters in it, and what it is (for
    errors)."""

    work: object
    flat: torch.Tensor
    params: list
    what: str


def start_sum(group, params: list, what: str) -> PendingSum:
    """Start summing ``params``' gradients (and presence flags) over ``group``.

    Args:
        group: the process group (every member passes the same parameters in the same order).
        params: non-empty list of parameters; ``.grad`` a tensor of the parameter's shape, or ``None``.
        what: names the collective in errors (``"the data-parallel all-reduce of stage 2"``).
    Raises:
        CommError: the collective could not be started (names ``what``).
    """
    parts = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    parts += [torch.full((1,), float(p.grad is not None), dtype=part.dtype, device=part.device)
              for p, part in zip(params, parts)]
    flat = _flatten_dense_tensors(parts)
    try:
        work = group.allreduce([flat])  # sum
    except RuntimeError as exc:
        raise CommError(what, exc) from None
    return PendingSum(work, flat, params, what)


def finish_sum(pending: PendingSum, divisor: int) -> None:
    """Wait for a sum and write it into every parameter's ``.grad``: the sum divided by ``divisor`` when any member
    had a gradient for it, else ``None``."""
    wait(pending.work, pending.what)
    params = pending.params
    totals = _unflatten_dense_tensors(pending.flat, [*params, *(p.new_empty(1) for p in params)])
    flags = pending.flat[-len(params):].tolist()  # one read (one device sync), not one per parameter
    for p, total, flag in zip(params, totals, flags):
        write_sum(p, total, flag > 0, divisor)


def write_sum(param, total, present: bool, divisor: int) -> None:
    """Set ``param.grad`` from the summed gradient ``total`` (same shape and dtype): ``None`` when no member had a
    gradient (``present`` False), else ``total / divisor``, into the existing ``.grad`` when there is one."""
    if not present:
        param.grad = None
        return
    if divisor > 1:
        total = total.div_(divisor)
    if param.grad is not None:
        param.grad.copy_(total)
    else:
        param.grad = total.clone()
