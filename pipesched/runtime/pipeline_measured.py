"""``Pipeline``'s measurements: this rank's and the whole pipeline's measured timelines of the last step (or
forward), and the last step's peak activation and device memory. A mixin of
:class:`~pipesched.runtime.pipeline.Pipeline`, which records them (:class:`~pipesched.runtime.measured.StepRecord`)."""
from __future__ import annotations

from .call_args import shown
from .failure import PipelineError
from .measured import gather_timeline, local_timeline
from .misfit import refused_on_misfit


class PipelineMeasured:
    """The measurements of :class:`~pipesched.runtime.pipeline.Pipeline` (see the module)."""

    def timeline(self, kind: str = "step"):
        """This rank's measured :class:`~pipesched.timeline.Timeline` of the last training :meth:`step`
        (``None`` before one); ``kind="forward"``: of the last :meth:`forward` instead. A ``forward()`` after
        a ``step()`` leaves the step's timeline in place. ``meta["message_bytes"]``: ``{"SEND_F0.1>1": bytes, ...}``,
        what each of this rank's sends put on the wire (``gather_timeline()``'s: every rank's).

        Raises:
            PipelineError: this Pipeline failed (as every later call does): the failed step's events are partial,
                and an earlier step's would be passed off as the last one's."""
        record = self._record(kind)
        self._check_not_broken(f"timeline(kind={kind!r})")
        return None if record is None else local_timeline(record, self.program, self.pp_rank)

    @refused_on_misfit(lambda pipe, error: pipe._gather_timeline("step", error))
    def gather_timeline(self, kind: str = "step"):
        """The whole pipeline's measured timeline of the last training :meth:`step` (``kind="forward"``: of
        the last :meth:`forward`); collective over the pipeline's ranks, through :meth:`run_collective` (a closed
        or failed pipeline, or a rank lost or failed meanwhile: the error :meth:`step` gives, on every rank).

        Every rank's ``kind`` and its own verdict on it travel in the first, marked row of the call
        (:mod:`~pipesched.runtime.call_args`), before any event, so a bad call is refused on every rank at once and
        the pipeline stays usable:

        Raises:
            TypeError, ValueError: ``kind`` is not a str (``TypeError``), or not ``"step"`` / ``"forward"``
                (``ValueError``); ``RuntimeError``: no finished ``kind`` yet. Where every rank passed the same
                ``kind``, each raises its own error.
            ValueError: the ranks passed different ``kind`` (``gather_timeline: the pipeline ranks passed different
                kind: 'step' on pipeline rank(s) [0], 'fwd' on pipeline rank(s) [1]; ...``), on every rank.
            TypeError, ValueError, RuntimeError: only some ranks refused the same ``kind`` (e.g. no finished step on
                one rank): the first refusing rank's type on every rank, ``gather_timeline: pipeline rank R refused
                its call: <its error>``.
            TypeError: arguments that do not fit (``gather_timeline(kinds="step")``), carried the same way
                (:mod:`~pipesched.runtime.misfit`).
            RuntimeError, PipelineError: a closed or failed pipeline, as :meth:`step`; a rank failed meanwhile."""
        return self._gather_timeline(kind)

    def _gather_timeline(self, kind, refusal: TypeError | None = None):
        """:meth:`gather_timeline`; ``refusal``: this rank's call did not fit its signature (then ``kind`` is the
        default, what the row shows)."""
        self._check_local(None, None)
        record = None
        try:
            if refusal is not None:
                raise refusal
            record = self._record(kind)
            if record is None:
                raise RuntimeError(f"gather_timeline(kind={kind!r}) needs a finished {kind}()")
        except (TypeError, ValueError, RuntimeError) as exc:  # ruled on in the meeting row: no rank waits
            record, refusal = None, exc
        return self._collective(lambda pp_group, _: gather_timeline(record, self.program, self.pp_rank, pp_group,
                                                                    self.device, kind, refusal), False,
                                "gather_timeline")

    @property
    def learned_steps(self) -> int:
        """How many ``step()`` and ``forward()`` calls so far learned their message metas (shape headers, slower):
        the first of each input signature and settings, and one whose metas left the cache (32 kept)."""
        return self._learned

    @property
    def peak_activation_bytes(self) -> int | None:
        """Bytes of activations this rank held for backward at the peak of the last training :meth:`step`
        (``None`` before one; a later ``forward()`` does not change it).

        Raises:
            PipelineError: this Pipeline failed (as :meth:`timeline` does): the last step failed, and the last
                good step's peak would be passed off as its."""
        self._check_not_broken("peak_activation_bytes")
        record = self._records["step"]
        return None if record is None else record.peak

    @property
    def peak_memory_allocated(self) -> int | None:
        """On CUDA: bytes of device memory allocated at the peak of the last training :meth:`step` above what
        was allocated when it began (``torch.cuda.max_memory_allocated``; activations, gradients and
        temporaries alike). ``None`` on CPU or before a step. Each step resets the device's peak statistics.

        Raises:
            PipelineError: this Pipeline failed (as :meth:`timeline` does): the last step failed, and the last
                good step's peak would be passed off as its."""
        self._check_not_broken("peak_memory_allocated")
        record = self._records["step"]
        return None if record is None else record.allocated

    def _check_not_broken(self, what: str) -> None:
        """Raise, for the measurement ``what``, the :class:`PipelineError` of a Pipeline that failed (the last step
        failed: an earlier step's measurement would be passed off as its)."""
        if self._broken is not None:
            raise PipelineError(self._broken.record, self.grid.world_rank,
                                f"{what}: this Pipeline failed in an earlier step")

    def _record(self, kind: str):
        if not isinstance(kind, str):
            raise TypeError(f"kind must be 'step' or 'forward' (a str), got {shown(kind)}")
        if kind not in self._records:
            raise ValueError(f"kind must be 'step' or 'forward', got {kind!r}")
        return self._records[kind]
