"""What a rank's ``TIE_REDUCE`` does: start one asynchronous sum per tie it holds (tie order), wait at the step's end.

The sum runs over the tie's group (:func:`~pipesched.runtime.ties.make_tie_groups`: the tie's ranks in every
replica), so after dividing by ``dp_size`` every copy's gradient is the average over replicas of the sum over the
tie's uses, the gradient of the unsplit model trained data-parallel. Every member gets the same result of one
collective, so the copies' gradients, and after an optimizer step the copies, stay bitwise identical. The stage's
data-parallel ALL_REDUCE leaves tied parameters out (:meth:`TieReducer.untied`): no tensor is in two collectives.
"""
from __future__ import annotations

from .grad_sum import finish_sum, start_sum


class TieReducer:
    """The tied-gradient sums of one rank.

    Args:
        params: {tie number: this rank's copies of the parameters of that tie group}
            (:func:`~pipesched.runtime.ties.tied_params`).
        groups: {tie number: its process group} for the same ties.
        dp_size: data-parallel replicas (the sum is divided by it).
        keeps: the tie numbers whose gradient from earlier steps this rank's copies carry into the sum: those where
            it is the tie's first pipeline rank (so each replica counts it once; see :meth:`begin`).
    """

    def __init__(self, params: dict, groups: dict, dp_size: int, keeps=()) -> None:
        self.params, self.groups, self.dp_size = params, groups, dp_size
        self.keeps = frozenset(keeps)
        self.tied = {id(p) for ps in params.values() for p in ps}
        self.pending: list = []

    def begin(self) -> None:
        """At a training step's start, before any backward: gradients accumulate across steps (``step()`` twice
        without ``zero_grad``), and every copy holds the same ``.grad`` G0 from the last sum. The sum must count G0
        once per replica, not once per copy, so every copy but the tie's first pipeline rank's zeroes its G0 in
        place (keeping ``.grad`` a tensor: it had a gradient); after the sum every copy holds G0 + this step's sum,
        as the unsplit model's one parameter would."""
        for k, params in self.params.items():
            if k not in self.keeps:
                for p in params:
                    if p.grad is not None:
                        p.grad.zero_()

    def untied(self, params: dict) -> dict:
        """``params`` ({stage: [parameters]}) without the tied ones (what the data-parallel ALL_REDUCE averages)."""
        return {s: [p for p in ps if id(p) not in self.tied] for s, ps in params.items()}

    def start(self) -> None:
        """Start the sum of each tie's gradients over its group, in tie order (:func:`~.grad_sum.start_sum`: each
        copy takes part whatever its ``.grad`` is, ``None`` (its stages did not use it, or it was frozen) as zeros
        with a presence flag).

        Raises:
            CommError: the collective could not be started (names the tie).
        """
        self.pending = [start_sum(self.groups[k], self.params[k], f"the tied-gradient sum of tie {k}")
                        for k in sorted(self.params)]

    def finish(self) -> None:
        """Wait for the sums started this step and write each result into ``.grad``, identically on every copy
        (:func:`~.grad_sum.finish_sum`): when any copy of a parameter (any rank, any replica) had a gradient, every
        copy's ``.grad`` becomes the sum divided by ``dp_size`` (frozen or not: the copies must stay identical);
        when none had one, every ``.grad`` stays ``None``."""
        pending, self.pending = self.pending, []
        for started in pending:
            finish_sum(started, self.dp_size)
