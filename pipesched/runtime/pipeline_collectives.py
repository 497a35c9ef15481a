"""``Pipeline``'s collective calls outside ``step()``: :meth:`~PipelineCollectives.run_collective` (the frame any
extension's collective runs in: refused on a closed or failed pipeline, a failure on any rank ending every rank) and
``clip_grad_norm_`` with its :attr:`~PipelineCollectives.anticipate_clip` switch. A mixin of
:class:`~pipesched.runtime.pipeline.Pipeline`, which holds the state these methods use."""
from __future__ import annotations

import torch

from .call_args import meet_with_argument, shown
from .clipping import clip_grad_norm_ as clip_all_stages
from .clipping import refuse as refuse_clip
from .collective import fail_every_rank, peer_loss_as_comm_error
from .handshake import COLLECTIVE_MARK
from .misfit import refused_on_misfit


class PipelineCollectives:
    """The collective calls of :class:`~pipesched.runtime.pipeline.Pipeline` outside ``step()`` (see the module)."""

    @refused_on_misfit(lambda pipe, error: fail_every_rank(pipe, "run_collective", error))
    def run_collective(self, work, meet: bool = True):
        """Run ``work(pp_group, dp_group)`` -- a collective of the caller's over this pipeline's process groups
        (``dp_group`` is None without data parallelism) -- as a step runs: refused on a closed or failed pipeline
        (as :meth:`step`), and a failure on any rank (an exception, a lost peer, a timeout) ends every rank with a
        ``PipelineError``. Call it on every rank. For extensions such as :meth:`clip_grad_norm_` and
        :class:`~pipesched.runtime.GradScaler`. Returns what ``work`` returns. The ``PipelineError`` names the rank
        that failed first: a lost peer (its connection closed) is named, not this rank
        (:mod:`~pipesched.runtime.collective`); ``work``'s own exception on this rank names this rank.

        ``meet`` (default True): first meet the other pipeline ranks in one small all-gather of a marked row
        (:func:`~pipesched.runtime.handshake.meet`, ~0.5 ms on 2 CPU ranks), so a rank that is in another call
        meanwhile (its next ``step()``, ``clip_grad_norm_``, ``gather_timeline``) ends every rank at once with a
        ``PipelineError`` naming both calls, instead of a mismatched collective that waits for the timeout (over the
        pipeline group only: with ``dp_size > 1``, replicas in different calls still wait for the timeout).
        ``False``: for a ``work`` that opens with such a row of its own (clip's, the GradScaler's vote).

        A ``work`` that is not callable, or a ``meet`` that is not a bool (then this rank meets the others), is this
        rank's ``TypeError``, carried in the meeting row (:mod:`~pipesched.runtime.call_args`): every rank raises a
        ``TypeError`` before ``work`` runs (its own where every rank refused, else ``run_collective: pipeline rank R
        refused its call: ...``), and the pipeline stays usable. With ``meet=False`` there is no row to carry it: a
        non-callable ``work`` fails every rank as ``work``'s own exception would. So do arguments that do not fit
        (``run_collective(work, meat=False)``: whether the other ranks meet first is not known; a ``PipelineError``
        naming this rank's ``TypeError`` on every rank, at once, :mod:`~pipesched.runtime.misfit`)."""
        return self._collective(work, meet, "run_collective")

    def _collective(self, work, meet: bool, call: str):
        """:meth:`run_collective` for ``call``, the public call running it (``"clip_grad_norm_"``, ...), named where
        it fails: ``failed in a collective call outside any step (<call>)``."""
        self._check_local(None, None)
        refusal = None
        if not callable(work):
            refusal = TypeError(f"work must be a callable work(pp_group, dp_group), got {shown(work)}")
        elif not isinstance(meet, bool):
            refusal = TypeError(f"meet must be True or False, got {shown(meet)}")

        def run():
            if meet is not False:  # the refusal rides in the row; work's repr differs by rank: not compared
                meet_with_argument(self._pp_group, self.program.num_ranks, self.device, COLLECTIVE_MARK,
                                   "the collective of run_collective", "run_collective", "work", work, refusal,
                                   compare=False)  # as a lost peer in work is named
            elif refusal is not None:
                raise refusal
            return work(self._pp_group, self._dp_group)

        return self._guarded(lambda: peer_loss_as_comm_error(run, f"the collective of {call}"),
                             where=f"in a collective call outside any step ({call})")

    @property
    def anticipate_clip(self) -> bool:
        """Whether steps after a :meth:`clip_grad_norm_` send each rank's norm part at their end, so the next call
        needs no collective (:mod:`~pipesched.runtime.norm_parts`). Default False: every call takes one
        all-gather, always correct. Opt in (``True`` on every rank; False on any rank: no step anticipates) only
        for a loop that, between ``step()`` and ``clip_grad_norm_()``, changes gradients on every rank alike or
        not at all and calls it on every rank with the same arguments: a rank whose gradients alone changed
        takes the all-gather while the others clip by the anticipated norm and step, so they clip by a stale norm
        once before the next step ends every rank with a ``PipelineError``."""
        return self._norm_parts.enabled

    @anticipate_clip.setter
    def anticipate_clip(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"anticipate_clip must be True or False, got {value!r}")
        self._norm_parts.enabled = value

    @refused_on_misfit(refuse_clip)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole pipeline (collective over its ranks): scales every
        ``.grad`` of this rank by ``min(max_norm / (total + 1e-6), 1)``, ``total`` the norm of all gradients of
        every stage (``.grad is None`` skipped; data-parallel replicas counted once). Returns ``total``: a 0-dim
        tensor on this rank's device, the same value on every rank, of the dtype torch would return for the
        unsplit model (float32 for float32 gradients). See :mod:`pipesched.runtime.clipping`. Right after a step that
        anticipated this call (same ``max_norm`` and ``norm_type`` as the last call: :attr:`anticipate_clip`), it
        combines the norm parts that step sent and communicates nothing (:mod:`pipesched.runtime.norm_parts`).

        Raises:
            ValueError: a bad ``max_norm`` (a number or 0-dim tensor > 0), ``norm_type`` (> 0 or inf),
                ``error_if_nonfinite`` or ``foreach``; the message names the argument. This rank still joins the
                others' all-gathers with a refusal (:func:`~pipesched.runtime.clipping.refuse`), so every other rank
                of the job (every replica) raises a ``ValueError`` quoting it and naming this rank instead of waiting
                or clipping; gradients unchanged, the pipeline stays usable. Arguments that do not fit
                (``clip_grad_norm_(1.0, norm=2)``) are refused the same way (:mod:`~pipesched.runtime.misfit`): a
                ``TypeError`` on this rank, a ``ValueError`` quoting it elsewhere.
            ValueError: ranks passed different ``max_norm``, ``norm_type``, ``error_if_nonfinite`` or ``foreach``
                (names the argument and each value with its ranks; data-parallel replicas compared too, in one more
                small all-gather over the data-parallel group): on every rank of the job, gradients unchanged, the
                pipeline stays usable.
            PipelineError: after an anticipating step, the ranks' calls differed (arguments, or gradients changed
                since the step on some ranks only): on every rank, at the next collective of the pipeline group.
            RuntimeError: ``error_if_nonfinite`` and ``total`` is nan or inf: on every rank, gradients unscaled.
            RuntimeError, PipelineError: a closed or failed pipeline, as :meth:`step`; a rank failed meanwhile.
        """
        return clip_all_stages(self, max_norm, norm_type, error_if_nonfinite, foreach)
