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
        """Start the sum of each tie's gradients over its group, in tie order. A copy without a gradient this
        step (its stages did not use it) contributes zeros.

        Raises:
            CommError: the collective could not be started (names the tie).
        """
        self.pending = []
        for k in sorted(self.params):
            params = self.params[k]
            flat = _flatten_dense_tensors([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
            try:
                work = self.groups[k].allreduce([flat])  # sum
            except RuntimeError as exc:
                raise CommError(f"the tied-gradient sum of tie {k}", exc) from None
            self.pending.append((k, work, flat, params))

    def finish(self) -> None:
        """Wait for the sums started this step and write each result (divided by ``dp_size``) into ``.grad``."""
        pending, self.pending = self.pending, []
        for k, work, flat, params in pending:
            wait(work, f"the tied-gradient sum of tie {k}")
            if self.dp_size > 1:
                flat.div_(self.dp_size)
            for p, total in zip(params, _unflatten_dense_tensors(flat, params)):
                if p.grad is not None:
                    p.grad.copy_(total)
                elif p.requires_grad:
                    p.grad = total.clone()
