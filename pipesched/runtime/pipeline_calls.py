"""``Pipeline``'s call machinery: what every call checks first (closed, failed, the model changed since
construction), how a call runs so that any failure reaches every rank (:meth:`PipelineCalls._guarded`), and how a
``step()``/``forward()`` whose arguments do not fit is refused on every rank. A mixin of
:class:`~pipesched.runtime.pipeline.Pipeline`."""
from __future__ import annotations

import time

from .failure import CommError, PipelineError
from .misfit import guard_overrides
from .pipeline_failure import fail
from .refusals import Rejected
from .step_run import run


class PipelineCalls:
    """The call machinery of :class:`~pipesched.runtime.pipeline.Pipeline` (see the module)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        guard_overrides(cls)  # a subclass's own step(), forward(), ... is refused on every rank too

    def _check_local(self, x, target) -> None:
        """Only what every rank decides alike; the input itself is checked by the first stage's rank,
        which tells the others (see :class:`~pipesched.runtime.handshake.Handshake`), so all ranks raise the same
        ValueError."""
        if self._closed:
            raise RuntimeError("this Pipeline was closed; create a new one")
        if self._broken is not None:
            raise PipelineError(self._broken.record, self.grid.world_rank, "this Pipeline failed in an earlier step")

    def _refuse_call(self, error: TypeError, train: bool) -> None:
        """This rank's ``step()`` (``train``) or ``forward()`` got arguments that do not fit (``error``): open the
        step with it as this rank's refusal, so every rank raises it (:mod:`~pipesched.runtime.misfit`)."""
        self._check_local(None, None)
        self._guarded(lambda: run(self, None, None, train=train, refusal=error))

    def _check_built(self) -> None:
        """Raises ValueError: a layer of the model or a parameter of this rank's stages is not the one of
        construction (:class:`~pipesched.runtime.built.Built`: names it and what to do instead)."""
        change = self._built.changed()
        if change is not None:
            raise ValueError(change)

    def _guarded(self, run, where: str | None = None):  # where: what runs, for a failure outside any instruction
        self._running += 1  # close() refuses to run inside a call (a layer's forward, a hook, another thread)
        self._away_s = time.monotonic() - self._idle_since  # said if the store host is gone (lost_rank.py)
        try:
            return run()
        except Rejected as exc:  # every rank refused the call alike: a plain ValueError (TypeError), no record
            raise exc.kind(str(exc)) from exc.__cause__
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the other ranks
            error = fail(self, exc, where)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # the others read the record; here Ctrl-C and
                raise  # sys.exit() stay themselves, not a PipelineError that `except Exception` would swallow
            raise error from (None if isinstance(exc, CommError) else exc)
        finally:
            self._running -= 1
            self._idle_since = time.monotonic()
