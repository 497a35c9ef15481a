"""What a rank's ``TIE_REDUCE`` does: start one asynchronous sum per tie it holds (tie order), wait at the step's end.

The sum runs over the tie's group (:func:`~pipesched.runtime.ties.make_tie_groups`: the tie's ranks in every
replica), so after dividing by ``dp_size`` every copy's gradient is the average over replicas of the sum over the
tie's uses, the gradient of the unsplit model trained data-parallel. Every member gets the same result of one
collective, so the copies' gradients, and after an optimizer step the copies, stay bitwise identical. The stage's
data-parallel ALL_REDUCE leaves tied parameters out (:meth:`TieReducer.untied`): no tensor is in two collectives.
"""
from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .failure import CommError
from .transport import wait


class TieReducer:
    """The tied-gradient sums of one rank.

    Args:
        params: {tie number: this rank's copies of the parameters of that tie group}
            (:func:`~pipesched.runtime.ties.tied_params`).
        groups: {tie number: its process group} for the same ties.
        dp_size: data-parallel replicas (the sum is divided by it).
    """

    def __init__(self, params: dict, groups: dict, dp_size: int) -> None:
        self.params, self.groups, self.dp_size = params, groups, dp_size
        self.tied = {id(p) for ps in params.values() for p in ps}
        self.pending: list = []

    def untied(self, params: dict) -> dict:
        """``params`` ({stage: [parameters]}) without the tied ones (what the data-parallel ALL_REDUCE averages)."""
        return {s: [p for p in ps if id(p) not in self.tied] for s, ps in params.items()}

    def start(self) -> None:
        """Start the sum of each tie's gradients over its group, in tie order. Each copy takes part whatever its
        ``.grad`` is: a tensor (its own dtype and shape), or ``None`` (its stages did not use it, or it was frozen),
        sent as zeros. One presence flag per parameter (an extra element, 1 when this copy has a gradient, 0 when
        not) travels in the same flat buffer, so :meth:`finish` tells "no copy had a gradient" from a zero sum.

        Raises:
            CommError: the collective could not be started (names the tie).
        """
        self.pending = []
        for k in sorted(self.params):
            params = self.params[k]
            parts = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            parts += [torch.full((1,), float(p.grad is not None), dtype=part.dtype, device=part.device)
                      for p, part in zip(params, parts)]
            flat = _flatten_dense_tensors(parts)
            try:
                work = self.groups[k].allreduce([flat])  # sum
            except RuntimeError as exc:
                raise CommError(f"the tied-gradient sum of tie {k}", exc) from None
            self.pending.append((k, work, flat, params))

    def finish(self) -> None:
        """Wait for the sums started this step and write each result into ``.grad``, identically on every copy:
        when any copy of a parameter (any rank, any replica) had a gradient, every copy's ``.grad`` becomes the sum
        divided by ``dp_size`` (frozen or not: the copies must stay identical); when none had one, every ``.grad``
        stays ``None``, as the unsplit model's would (so an optimizer skips it, weight decay included)."""
        pending, self.pending = self.pending, []
        for k, work, flat, params in pending:
            wait(work, f"the tied-gradient sum of tie {k}")
            totals = _unflatten_dense_tensors(flat, [*params, *(p.new_empty(1) for p in params)])
            for p, total, flag in zip(params, totals[:len(params)], totals[len(params):]):
                write_sum(p, total, bool(flag.item() > 0), self.dp_size)


def write_sum(param, total, present: bool, dp_size: int) -> None:
    """Set ``param.grad`` from the tie's summed gradient ``total`` (same shape and dtype): ``None`` when no copy had
    a gradient (``present`` False), else ``total / dp_size``, into the existing ``.grad`` when there is one."""
    if not present:
        param.grad = None
        return
    if dp_size > 1:
        total = total.div_(dp_size)
    if param.grad is not None:
        param.grad.copy_(total)
    else:
        param.grad = total.clone()
