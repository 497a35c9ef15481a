"""Measured timelines: this rank's events of the last step, or every pipeline rank's, clock-aligned."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

from ..ir import Instr
from ..timeline import Event, Timeline, peak_inflight
from .failure import CommError
from .call_args import meet_with_argument
from .handshake import TIMELINE_MARK


@dataclass
class StepRecord:
    """What one rank measured in its last ``step()`` or ``forward()``.

    Attributes:
        events: ``[instr, start mark, end mark]`` per instruction run, in run order (marks of ``clock``); a
            receive's end is when its data was awaited, an ``ALL_REDUCE`` / ``TIE_REDUCE``'s when the step's end
            awaited its result (it overlaps the instructions after it).
        origin: the mark of the step's start.
        clock: the :mod:`~pipesched.runtime.clock` that made the marks.
        wall0: ``time.time()`` at the step's start (aligns the ranks' timelines).
        peak: bytes of activations held for backward at this rank's peak.
        allocated: CUDA bytes allocated at the step's peak above its start, or ``None`` (CPU).
        train: a training ``step()`` (else ``forward()``).
        dp_rank: this rank's data-parallel replica.
        sent: ``{SEND instruction: bytes}``: what each of this rank's SEND_F / SEND_B put on the wire (the packed
            payload; while learning also the 4096-byte meta header of an activation, and the gradients' mask and
            dim orders).
    """

    events: list
    origin: object
    clock: object
    wall0: float
    peak: int
    allocated: int | None
    train: bool
    dp_rank: int
    sent: dict = field(default_factory=dict)
    _seconds: list | None = field(default=None, repr=False)

    def seconds(self) -> list:
        """``(instr, start, end)`` in seconds from the step's start, from the marks the executor recorded (turned
        into seconds once, when first asked: on CUDA this waits for the step's events)."""
        if self._seconds is None:
            marks = [m for _, start, end in self.events for m in (start, end)]
            at = self.clock.seconds(self.origin, marks)
            self._seconds = [(instr, at[2 * k], at[2 * k + 1]) for k, (instr, _, _) in enumerate(self.events)]
        return self._seconds


def local_timeline(record: StepRecord, program, pp_rank: int) -> Timeline:
    """This rank's events of the last step (seconds from its start); ``peak_activation_bytes`` holds this
    rank's measured peak and NaN for the other ranks."""
    peaks = tuple(float(record.peak) if r == pp_rank else math.nan for r in range(program.num_ranks))
    events = tuple(Event(pp_rank, instr, start, end) for instr, start, end in record.seconds())
    return Timeline(events, program.num_ranks, "measured", _meta(record, program),
                    _inflight(program, record.train), peaks, ranks=(pp_rank,))


def gather_timeline(record: StepRecord | None, program, pp_rank: int, group, device=None, kind: object = "step",
                    refusal: BaseException | None = None) -> Timeline:
    """Every pipeline rank's events of the last step in one timeline (collective over the pipeline group).

    Clocks are aligned with each rank's wall-clock time at its step start (exact on one host; across
    hosts as good as their clock synchronisation): time 0 is the earliest rank's start.

    ``device``: where the meeting row goes (the pipeline's device; None: CPU). ``kind``: the caller's argument and
    ``refusal``: this rank's own error about it (a bad ``kind``, no finished ``kind``; ``record`` is then None), both
    carried in the row with which the ranks meet, before anything else travels
    (:func:`~pipesched.runtime.call_args.meet_with_argument`).

    Raises:
        CommError: the all-gather failed (a peer is gone, or the timeout passed); the Pipeline turns it into a
            ``PipelineError`` naming the rank that failed first or was lost.
        RuntimeError: some pipeline ranks are in another collective call
            (:func:`~pipesched.runtime.handshake.check_rows_meet`).
        Rejected: a rank refused its ``kind``, or the ranks passed different ones
            (:func:`~pipesched.runtime.call_args.judge`): on every rank, before the events travel.
    """
    meet_with_argument(group, program.num_ranks, device, TIMELINE_MARK,  # every rank in gather_timeline(), same kind
                       "the all-gather of gather_timeline over the pipeline group", "gather_timeline", "kind", kind,
                       refusal)
    mine = (pp_rank, record.wall0, [(str(i), s, e) for i, s, e in record.seconds()], record.peak,
            _message_bytes(record))
    gathered = [None] * program.num_ranks
    try:
        dist.all_gather_object(gathered, mine, group=group)
    except RuntimeError as exc:
        raise CommError("the all-gather of gather_timeline over the pipeline group", exc) from None
    origin = min(g[1] for g in gathered)
    events, peaks, sent = [], [0.0] * program.num_ranks, {}
    for rank, wall0, items, peak, nbytes in gathered:
        sent.update(nbytes)
        shift = wall0 - origin
        events.extend(Event(rank, Instr.parse(text), s + shift, e + shift) for text, s, e in items)
        peaks[rank] = float(peak)
    return Timeline(tuple(events), program.num_ranks, "measured", dict(_meta(record, program), message_bytes=sent),
                    _inflight(program, record.train), tuple(peaks))


def _meta(record: StepRecord, program) -> dict:
    return {"schedule": program.schedule, "ranks": program.num_ranks, "microbatches": program.num_microbatches,
            "virtual_stages": program.num_stages // max(1, program.num_ranks), "dp_size": program.dp_size,
            "dp_rank": record.dp_rank, "step": "train" if record.train else "forward",
            "clock": record.clock.name, "message_bytes": _message_bytes(record),
            **({"ties": [list(tie) for tie in program.ties]} if program.ties else {})}


def _message_bytes(record: StepRecord) -> dict:
    """``{"SEND_F0.1>1": bytes, ...}``: what each SEND of the record put on the wire."""
    return {str(instr): nbytes for instr, nbytes in record.sent.items()}


def _inflight(program, train: bool) -> tuple[int, ...]:
    if train:
        return peak_inflight(program.ranks)
    return tuple(0 for _ in program.ranks)
