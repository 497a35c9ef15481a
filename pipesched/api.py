"""The compiler's front door: a schedule name and sizes in, a lowered and proven program out."""
from __future__ import annotations

from .errors import ScheduleArgumentError
from .ir import Program
from . import lower
from .schedules import get_schedule
from .validate import validate


def build(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None) -> Program:
    """The compute-only program (F, B, ... per rank, no communication) of a registered schedule.

    Args:
        schedule: a registered name (``pipesched list``).
        num_ranks: pipeline ranks ``p`` >= 1.
        num_microbatches: microbatches per step ``m`` >= 1.
        virtual_stages: stages per rank ``v``; ``None`` takes the schedule's default.
    Raises:
        UnknownScheduleError: ``schedule`` is not registered (lists the valid names).
        ScheduleArgumentError: a size the schedule cannot run (names the argument and what is valid).
    """
    info = get_schedule(schedule)
    v = info.default_virtual_stages if virtual_stages is None else virtual_stages
    return info.build(num_ranks, num_microbatches, v)


def _flags(name: str, value, num_stages: int):
    """``True``/``False`` as given, else the checked list of per-stage bools.

    Raises:
        ScheduleArgumentError: see :func:`pipesched.lower.stage_flags` (names ``name``).
    """
    if isinstance(value, bool):
        return value
    try:
        return lower.stage_flags(value, num_stages, name)
    except ValueError as exc:
        raise ScheduleArgumentError(str(exc)) from None


def compile_program(
    schedule: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    dp_size: int = 1,
    recompute=False,
    split_backward=False,
) -> Program:
    """Build, lower and validate: the program an executor runs.

    Passes, in order: :func:`~pipesched.lower.split_backward` (if ``split_backward``),
    :func:`~pipesched.lower.add_recompute` (if ``recompute``),
    :func:`~pipesched.lower.add_send_recv` (``check=False``: the builder's program is not validated on
    its own, the lowered one is), :func:`~pipesched.lower.add_all_reduce` (if ``dp_size > 1``),
    then :func:`~pipesched.validate.validate`.

    Args:
        recompute: ``False``, ``True`` (every stage) or one bool per stage (``p * v`` of them).
        dp_size: data-parallel replicas >= 1.
        split_backward: split the backward of stages into ``I`` and ``W`` so the input gradient is sent before the
            weight gradient is computed: ``False`` (none), ``True`` (every stage whose input gradient goes
            to another rank) or one bool per stage.
    Raises:
        UnknownScheduleError, ScheduleArgumentError: as :func:`build`.
        ScheduleError: the compiled program fails validation (a bug in a schedule; please report it).
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ScheduleArgumentError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    program = build(schedule, num_ranks, num_microbatches, virtual_stages)
    if split_backward is not False:
        program = lower.split_backward(program, _flags("split_backward", split_backward, program.num_stages))
    if recompute is not False:
        program = lower.add_recompute(program, _flags("recompute", recompute, program.num_stages))
    program = lower.add_all_reduce(lower.add_send_recv(program, check=False), dp_size)  # validated as a whole below
    return validate(program)
