"""Mixed precision across pipeline ranks: the autocast a Pipeline's stages run under, and a ``GradScaler`` whose
overflow verdict every rank of the job agrees on, so every rank skips (or takes) the optimizer step together."""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist

from .transport import wait

#: what ``Pipeline(autocast=...)`` accepts besides ``None``
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
#: the reductions :func:`all_reduce_over` can do group after group (an average cannot)
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


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


def all_reduce_over(tensor: torch.Tensor, op: str, groups) -> torch.Tensor:
    """Reduce ``tensor`` in place with ``op`` (``"sum"``, ``"max"`` or ``"min"``) over each group of ``groups`` in
    turn (``None`` entries skipped): over the pipeline group, then the data-parallel group, that is every rank of
    the job. Returns ``tensor``.

    Raises:
        ValueError: an unknown ``op``.
        CommError: a peer is gone or the wait timed out (the Pipeline turns it into a ``PipelineError``).
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
    for group in groups:
        if group is not None:
            work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=True)
            wait(work, f"an all-reduce ({op}) over every rank of the job")
    return tensor


def loss_scaling(scaler, pipe):
    """What ``pipe.step(..., scaler=scaler)`` multiplies each microbatch's loss by before its backward: ``None``
    (no scaler: nothing) or ``scaler.scale`` (the loss times the current scale); counts the step on ``scaler``.

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
    scaler.scaled_steps += 1
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
        scaler.step(opt); scaler.update(); opt.zero_grad()

    Only :meth:`_unscale_grads_` differs from torch's (the one place torch checks gradients, for ``unscale_``
    and for fused optimizers alike): after checking this rank's gradients it all-reduces (MAX) the verdict over
    every rank of the job. So ``unscale_`` and ``step`` are collective: call them on every rank, for the same
    optimizers in the same order.

    Args:
        pipe: the Pipeline whose ``step`` this scaler scales; the scale lives on its device (CPU or CUDA).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as ``torch.amp.GradScaler``.
    Attributes:
        scaled_steps: the ``pipe.step`` calls on this rank that got this scaler (every rank must count the same).
    Raises:
        TypeError: ``pipe`` is not a Pipeline.
    """

    def __init__(self, pipe, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        from .pipeline import Pipeline  # the pipeline imports this module

        if not isinstance(pipe, Pipeline):
            raise TypeError(f"pipe must be a pipesched.runtime.Pipeline, got {type(pipe).__name__}")
        super().__init__(pipe.device.type, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.pipe = pipe
        self.scaled_steps = 0
        if self.is_enabled():  # torch makes the scale at the first scale(), which only the last stage's rank calls
            self.scale(torch.zeros((), device=pipe.device))

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's unscale and inf/NaN check of this rank's gradients, then the verdict agreed (MAX) over every
        rank of the job, written back into every per-device flag torch reads in ``step`` and ``update``.

        Raises:
            ValueError (on every rank): ranks counted different numbers of ``pipe.step(..., scaler=...)`` calls,
                or none passed this scaler (the gradients were never scaled).
            PipelineError: a rank failed or timed out in the agreement, or torch's own check failed on some rank
                (e.g. float16 parameters: "Attempting to unscale FP16 gradients"): on every rank, naming that rank,
                instead of the others waiting for it until the timeout.
        """
        unscale = super()._unscale_grads_

        def agree(pp_group, dp_group):  # torch's local check inside: its error ends every rank, not this one only
            per_device = unscale(optimizer, inv_scale, found_inf, allow_fp16)
            local = sum(float(t) for t in per_device.values())  # one flag per device holding gradients (CPU: one)
            verdict = torch.tensor([local, self.scaled_steps, -self.scaled_steps], dtype=torch.float64,
                                   device=found_inf.device)
            return per_device, all_reduce_over(verdict, "max", (pp_group, dp_group))

        per_device, verdict = self.pipe.run_collective(agree)
        found, most, fewest = float(verdict[0]), int(verdict[1]), -int(verdict[2])
        if most != fewest:
            raise ValueError(f"scaler: pipe.step(..., scaler=...) got this GradScaler in {fewest} steps on some ranks "
                             f"of the job and {most} on others; pass it to pipe.step on every rank in every step")
        if most == 0:
            raise ValueError("scaler: no pipe.step() got this GradScaler, so the gradients were never scaled; call "
                             "pipe.step(x, target=y, scaler=scaler) before scaler.unscale_/step")
        for flag in per_device.values():
            flag.fill_(found)
        return per_device or {found_inf.device: found_inf.fill_(found)}  # a rank without gradients steps alike
