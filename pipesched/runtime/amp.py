"""Mixed precision across pipeline ranks: the autocast a Pipeline's stages run under, and a ``GradScaler`` whose
overflow verdict every rank of the job agrees on, so every rank skips (or takes) the optimizer step together."""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings

import torch

from .clip_replicas import float_bits
from .collective import fail_every_rank
from .failure import PipelineError
from .misfit import refused_on_misfit
from .scaler_vote import INTERVAL, SCALE, vote

#: what ``Pipeline(autocast=...)`` accepts besides ``None``
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
SCALER_CALL = "GradScaler's unscale_/step/update"  # the public calls its collectives run in, for failures


def checked_autocast(autocast, device: torch.device):
    """``autocast`` (``None``, ``torch.bfloat16`` or ``torch.float16``) if this torch can autocast stages on ``device``
    to it, else a ``ValueError`` naming the argument, its value and the valid values (checked before any
    communication)."""
    if autocast is None:
        return None
    if not isinstance(autocast, torch.dtype) or autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be None, torch.bfloat16 or torch.float16, got {autocast!r}")
    if device.type == "cuda" and autocast == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"autocast={autocast} but {device} does not support bfloat16; use autocast=torch.float16 "
                         f"(with a GradScaler) or None")
    with warnings.catch_warnings():  # an unsupported dtype only warns and disables autocast: ask whether it is on
        warnings.simplefilter("ignore")
        with torch.autocast(device.type, dtype=autocast):
            supported = torch.is_autocast_enabled(device.type)
    if not supported:
        raise ValueError(f"autocast={autocast} is not supported on {device.type} by torch {torch.__version__}; "
                         f"valid here: None" + ("" if device.type != "cpu" else " (or upgrade torch)"))
    return autocast


def autocast_context(device: torch.device, autocast):
    """A zero-argument factory of the context a stage's forward (``F``, ``R``, its loss) runs in: ``torch.autocast``
    to ``autocast`` on ``device``'s type, or a null context for ``None`` (the caller's autocast state applies)."""
    if autocast is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device.type, autocast)


def loss_scaling(scaler, pipe):
    """What ``pipe.step(..., scaler=scaler)`` multiplies each microbatch's loss by before its backward: ``None``
    (no scaler: nothing) or ``scaler.scale`` (the loss times the current scale). A local check, before the step's
    opening: the Pipeline carries its error in this rank's row of the opening, so every rank refuses the step
    alike (:func:`~pipesched.runtime.refusals.judge_own_checks`), and counts the step on ``scaler``
    (:attr:`GradScaler.scaled_steps`) only once every rank accepted it.

    Raises:
        TypeError: ``scaler`` is not a :class:`GradScaler` (a plain ``torch.amp.GradScaler`` would let ranks
            disagree on an overflow).
        ValueError: ``scaler`` was built for another Pipeline.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"scaler must be a pipesched.runtime.GradScaler built for this Pipeline (it agrees on an "
                        f"overflow across every rank), got {type(scaler).__module__}.{type(scaler).__name__}")
    if scaler.pipe is not pipe:
        raise ValueError("scaler was built for another Pipeline; build one per Pipeline: GradScaler(pipe)")
    return scaler.scale


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a :class:`~pipesched.runtime.Pipeline`: dynamic loss scaling (for
    ``autocast=torch.float16``) where every rank of the job (every pipeline rank of every replica) agrees on
    whether a gradient overflowed, so an inf/NaN gradient on ANY rank makes EVERY rank skip ``step()`` and
    ``update()`` lower the scale identically everywhere: the stages and the replicas never diverge.

    Build one on every rank, pass it to every ``pipe.step`` (the last stage backpropagates ``loss * scale``; the
    loss ``step`` returns stays unscaled), then use it as torch's::

        scaler = GradScaler(pipe)
        loss = pipe.step(x, target=y, scaler=scaler)
        scaler.unscale_(opt)                            # optional: before clipping
        scaler.step(opt); scaler.update()
        if opt is not None: opt.zero_grad()

    A rank that holds no parameters (``opt = None`` there, see README "A rank without parameters") runs the same
    loop with ``opt=None``: ``unscale_(None)`` and ``step(None)`` check nothing and step nothing but join the vote
    (so an overflow elsewhere skips every rank's step and ``update()`` changes the scale alike); with ``None``
    there, the other ranks use one optimizer each. ``update()`` without ``unscale_`` or ``step`` since the last
    update is a ``PipelineError`` on every rank caused by a ``ValueError`` saying so (torch's is an AssertionError;
    the other ranks, waiting in their vote, end at once), as is any error of ``unscale_`` or ``step`` on one rank
    alone (:meth:`_collective_call`).

    Only :meth:`_unscale_grads_` differs from torch's (the one place torch checks gradients, for ``unscale_``
    and for fused optimizers alike): after checking this rank's gradients every rank votes (:meth:`_vote`): ONE
    all-gather over the pipeline group of a row headed by ``SCALER_MARK``, as long as a step opening's,
    ``clip_grad_norm_``'s and ``gather_timeline``'s rows, so ranks in different calls meet and raise one error
    naming the calls (:func:`~pipesched.runtime.handshake.check_rows_meet`) at once; with data parallelism one
    more all-gather over the data-parallel group of what each pipeline decided. The verdict is the MAX over
    every rank of its found-inf flags (summed over its devices). So ``unscale_`` and ``step`` are collective:
    call them on every rank, for the same optimizers in the same order. A disabled scaler (``enabled=False``:
    torch's ``unscale_`` and ``step`` check nothing) joins the vote in its first ``unscale_`` or ``step`` only,
    so a scaler disabled on some ranks only is a ``ValueError`` on every rank there, and ranks that all disabled
    theirs communicate no more.

    Args:
        pipe: the Pipeline whose ``step`` this scaler scales; the scale lives on its device (CPU or CUDA).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as ``torch.amp.GradScaler``, checked
            (:func:`check_scaler_arguments`).
    Attributes:
        scaled_steps: the ``pipe.step`` calls on this rank that got this scaler and that every rank accepted (a
            step refused in its opening, on any rank, does not count; every rank must count the same).
    Raises:
        TypeError: ``pipe`` is not a Pipeline.
        ValueError: a bad argument, before any communication: ``init_scale`` not a finite number > 0,
            ``growth_factor`` not a finite number > 1, ``backoff_factor`` not a number strictly between 0 and 1,
            ``growth_interval`` not an int >= 1, ``enabled`` not True or False (names the argument and its value).
    """

    def __init__(self, pipe, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        from .pipeline import Pipeline  # the pipeline imports this module

        if not isinstance(pipe, Pipeline):
            raise TypeError(f"pipe must be a pipesched.runtime.Pipeline, got {type(pipe).__name__}")
        check_scaler_arguments(init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        super().__init__(pipe.device.type, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.pipe = pipe
        self.scaled_steps = 0
        self._no_optimizer = _NoOptimizer()  # what optimizer=None stands for (one object: torch keys by id)
        self._in_call = False  # in unscale_ or step (torch's step calls unscale_)
        self._agreed_checks = False  # between the vote and the end of its checks: what they raise, every rank raises
        self._joined = False  # disabled: its first unscale_/step voted, and every rank's scaler was disabled too
        if self.is_enabled():  # torch makes the scale at the first scale(), which only the last stage's rank calls
            self.scale(torch.zeros((), device=pipe.device))

    @refused_on_misfit(lambda scaler, error: scaler._collective_call(_raise, error))
    def unscale_(self, optimizer) -> None:
        """torch's ``unscale_``; ``optimizer=None`` on a rank without parameters (see the class). Collective: an
        error on this rank alone ends every rank (:meth:`_collective_call`), arguments that do not fit too
        (:mod:`~pipesched.runtime.misfit`)."""
        return self._collective_call(super().unscale_, self._optimizer_or_stand_in(optimizer))

    @refused_on_misfit(lambda scaler, error: scaler._collective_call(_raise, error))
    def step(self, optimizer, *args, **kwargs):
        """torch's ``step``; ``optimizer=None`` on a rank without parameters (see the class). Collective: an
        error on this rank alone ends every rank (:meth:`_collective_call`), a missing ``optimizer`` too."""
        return self._collective_call(super().step, self._optimizer_or_stand_in(optimizer), *args, **kwargs)

    def update(self, new_scale=None) -> None:
        """torch's ``update``.

        Raises:
            PipelineError: neither ``unscale_`` nor ``step`` ran on this rank since the last update (nothing to
                update from; the other ranks' ``unscale_``/``step`` wait for this rank's vote): on every rank,
                caused by a ``ValueError`` saying what to call (:func:`~pipesched.runtime.collective.fail_every_rank`:
                the other ranks end at once instead of waiting in their vote until the timeout).
        """
        if self.is_enabled() and new_scale is None and not any(
                state["found_inf_per_device"] for state in self._per_optimizer_states.values()):
            fail_every_rank(self.pipe, SCALER_CALL, ValueError(
                f"scaler: update() on pipeline rank {self.pipe.grid.pp_rank} without unscale_ or step since the last "
                f"update(); they are collective (every rank votes on an overflow): call scaler.step(opt) (and "
                f"scaler.unscale_(opt) before clipping) on every rank, with opt=None on a rank without parameters"))
        return super().update(new_scale)

    def _collective_call(self, call, *args, **kwargs):
        """``call(*args, **kwargs)`` (torch's ``unscale_`` or ``step``, which join the overflow vote). An exception it
        raises on this rank alone -- torch's own checks before the vote (``unscale_`` twice or after ``step``, ``step``
        twice, since the last ``update``; a ``closure``), the optimizer's ``step`` after it -- ends every
        rank with a ``PipelineError`` naming this rank and that exception (the other ranks wait for this one in
        the vote or in the next step); the ``ValueError`` every rank raises alike after the vote (the ranks'
        step counts or settings differ) leaves the pipeline usable. A disabled scaler votes once, in its first
        call (:meth:`_join_once`), then on nothing: as torch's.
        """
        if self._in_call:  # torch's step calls unscale_: the outermost call decides
            return call(*args, **kwargs)
        self._in_call, self._agreed_checks = True, False
        try:
            if not self.is_enabled() and not self._joined:
                self._join_once()
            return call(*args, **kwargs)
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of this rank must reach the other ranks
            if self._agreed_checks or not self.is_enabled():
                raise
            fail_every_rank(self.pipe, SCALER_CALL, exc)  # raises a PipelineError from exc
            raise
        finally:
            self._in_call = self._agreed_checks = False

    def _join_once(self) -> None:
        """A disabled scaler's vote, in its first ``unscale_`` or ``step``: torch's disabled path checks nothing and
        never reaches :meth:`_unscale_grads_`, so without it the enabled ranks would wait for this one in their
        vote until the timeout. Once every rank's scaler is disabled too, it votes no more.

        Raises:
            ValueError (on every rank): the scalers of some ranks are enabled (:func:`_judge`).
            PipelineError: as :meth:`_unscale_grads_`.
        """
        error, _found = self.pipe._collective(lambda pp_group, dp_group: self._vote(0.0, pp_group, dp_group),
                                                False, SCALER_CALL)
        self._agreed_checks = True
        if error:
            raise ValueError(error)
        self._agreed_checks, self._joined = False, True

    def _optimizer_or_stand_in(self, optimizer):
        return self._no_optimizer if optimizer is None else optimizer

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's unscale and inf/NaN check of this rank's gradients, then the verdict agreed (MAX) over every
        rank of the job (:meth:`_vote`), written back into every per-device flag torch reads in ``step`` and
        ``update``.

        Raises:
            ValueError (on every rank; the pipeline stays usable): the ranks' scalers differ in ``enabled``, ranks
                counted different numbers of ``pipe.step(..., scaler=...)`` calls (names the ranks with each count:
                those that passed it, those that did not), their scalers differ in scale, ``growth_factor``,
                ``backoff_factor`` or ``growth_interval`` (names the ranks with each value), or none passed this
                scaler (the gradients were never scaled): :func:`_judge`.
            PipelineError: a rank failed or timed out in the agreement, ranks are in different collective calls
                (e.g. one in ``unscale_`` while another opened its next step or is in ``gather_timeline``: a
                ``RuntimeError`` naming the calls), or torch's own check failed on some rank (e.g. float16
                parameters: "Attempting to unscale FP16 gradients"): on every rank, naming that rank, instead of
                the others waiting for it until the timeout.
        """
        unscale = super()._unscale_grads_
        grid = self.pipe.grid

        def agree(pp_group, dp_group):  # torch's local check inside: its error ends every rank, not this one only
            if optimizer is self._no_optimizer:
                with_grads = sum(p.grad is not None for p in self.pipe.parameters())
                if with_grads:  # they would be neither unscaled nor checked
                    raise ValueError(f"scaler: optimizer=None on pipeline rank {grid.pp_rank}, which holds "
                                     f"{with_grads} parameter(s) with gradients; None is for a rank without "
                                     f"parameters: pass this rank's optimizer")
            per_device = unscale(optimizer, inv_scale, found_inf, allow_fp16)
            local = sum(float(t) for t in per_device.values())  # one flag per device holding gradients (CPU: one)
            return per_device, self._vote(local, pp_group, dp_group)

        per_device, (error, found) = self.pipe._collective(agree, False, SCALER_CALL)  # the vote's rows meet
        self._agreed_checks = True  # every rank has the same verdict: what it raises below, every rank raises
        if error:
            raise ValueError(error)
        for flag in per_device.values():
            flag.fill_(found)
        self._agreed_checks = False  # the rest of unscale_/step is this rank's own (the optimizer's step)
        return per_device or {found_inf.device: found_inf.fill_(found)}  # a rank without gradients steps alike

    def _vote(self, found: float, pp_group, dp_group) -> tuple[str, float]:
        """This rank's verdict (``found``: its found-inf flags summed) and settings (:data:`~pipesched.runtime.
        scaler_vote.FIELDS`) voted on with every rank's, collective (:func:`~pipesched.runtime.scaler_vote.vote`:
        ONE all-gather over the pipeline group of a row headed by ``SCALER_MARK``, with data parallelism one more
        over the data-parallel group).

        Returns:
            ``(error, found)``: the ``ValueError`` text every rank of the job raises alike (``""``: none) and the
            MAX of every rank's ``found``.
        Raises:
            RuntimeError: ranks are in other collective calls (:func:`~pipesched.runtime.handshake.check_rows_meet`,
                or a replica elsewhere), on every rank that meets them.
            CommError: an all-gather failed (a peer is gone, or the timeout passed).
        """
        mine = [int(self.is_enabled()), self.scaled_steps, 0, float_bits(found), 0, 0, 0]
        if self.is_enabled():  # torch keeps no settings on a disabled scaler
            mine[INTERVAL] = int(self._growth_interval)
            mine[SCALE:] = [float_bits(v) for v in (self.get_scale(), self._growth_factor, self._backoff_factor)]
        return vote(self.pipe, mine, pp_group, dp_group)


def check_scaler_arguments(init_scale, growth_factor, backoff_factor, growth_interval, enabled) -> None:
    """``GradScaler``'s arguments as torch means them, checked before any communication (torch checks only
    ``growth_factor`` and ``backoff_factor``, with an assert, and only when enabled).

    Raises:
        ValueError: the first bad one, naming it, its value and what is valid.
    """
    def number(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    if not number(init_scale) or init_scale <= 0:
        raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
    if not number(growth_factor) or growth_factor <= 1:
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}")
    if not number(backoff_factor) or not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor must be a number between 0 and 1 (both excluded), got {backoff_factor!r}")
    if not isinstance(growth_interval, numbers.Integral) or isinstance(growth_interval, bool) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}")


class _NoOptimizer:
    """What ``optimizer=None`` stands for in torch's GradScaler on a rank without parameters: no parameter
    groups (nothing to unscale or check) and a ``step`` that does nothing."""

    param_groups = ()

    def step(self, *args, **kwargs):
        return None


def _raise(error: Exception):
    """Raise ``error``: the call :class:`GradScaler` runs in its collective path for arguments that do not fit."""
    raise error
