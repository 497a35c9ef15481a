"""One asynchronous gradient sum over a process group that keeps ``.grad is None`` right: the data-parallel
``ALL_REDUCE`` of a stage and the ``TIE_REDUCE`` of a tie both use it.

Every member flattens the same parameters, in the same order, whatever their ``.grad`` is on that rank: a tensor,
or ``None`` sent as zeros. One presence flag per parameter (an extra element: 1 when this copy has a gradient, 0
when not) travels in the same flat buffer. So the sum is over the same elements on every member even when one
replica's data left a parameter unused (without the flags the flat buffers would differ in length across members),
and a parameter no member had a gradient for keeps ``.grad`` None, as the unsplit model's would (an optimizer then
skips it, weight decay included), while one that any member had a gradient for gets the sum on every member.

Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are summed dense: each member
adds ``grad.to_dense()`` to the flat buffer, so the sum costs what the same parameter with a dense gradient costs
(its full size on the wire and one dense copy in memory, whatever rows were used) and works on every backend
(NCCL has no sparse all-reduce). A second flag per parameter counts the members whose gradient was sparse: when
every member that had one had a sparse gradient, every member's ``.grad`` becomes sparse again
(``to_sparse``, rows of zeros left out), else dense, as torch's own accumulation of a sparse and a dense gradient
into one ``.grad`` (a sparse embedding tied to a dense head) is dense.
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
    parts = [torch.zeros_like(p) if p.grad is None else _dense(p.grad) for p in params]
    flags = [float(p.grad is not None) for p in params]
    flags += [float(p.grad is not None and p.grad.is_sparse) for p in params]  # members whose gradient is sparse
    parts.append(torch.tensor(flags, dtype=parts[-1].dtype, device=parts[-1].device))  # one tensor: one copy
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
    params, n = pending.params, len(pending.params)
    totals = _unflatten_dense_tensors(pending.flat[:-2 * n], params)
    flags = pending.flat[-2 * n:].tolist()  # one read (one device sync), not one per parameter
    for p, total, flag, sparse in zip(params, totals, flags[:n], flags[n:]):
        write_sum(p, total, flag > 0, divisor, sparse=flag > 0 and sparse == flag)


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as a strided tensor: itself, or a dense copy of a sparse (or other non-strided) one."""
    return grad if grad.layout == torch.strided else grad.to_dense()


def write_sum(param, total, present: bool, divisor: int, sparse: bool = False) -> None:
    """Set ``param.grad`` from the summed gradient ``total`` (same shape and dtype, dense): ``None`` when no member
    had a gradient (``present`` False), else ``total / divisor``: sparse COO when ``sparse`` (every member that
    had a gradient had a sparse one; ``sparse_dim`` that of this member's gradient, else 1, the rows of an
    embedding), else into the existing ``.grad`` when there is a dense one."""
    if not present:
        param.grad = None
        return
    if divisor > 1:
        total = total.div_(divisor)
    grad = param.grad
    if sparse:
        param.grad = total.to_sparse(grad.sparse_dim() if grad is not None and grad.is_sparse else 1)
    elif grad is not None and grad.layout == torch.strided:
        grad.copy_(total)
    else:
        param.grad = torch.empty_like(param).copy_(total)  # laid out as the parameter (channels_last), as autograd's
