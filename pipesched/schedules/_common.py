"""Helpers shared by the schedule builders: argument checks and program assembly."""
from __future__ import annotations

from ..checks import check_positive
from ..errors import ScheduleArgumentError
from ..ir import Instr, Op, Program


def check_one_stage_sizes(name: str, num_ranks, num_microbatches, virtual_stages) -> tuple[int, int]:
    """(p, m) for a schedule with one stage per rank.

    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 1``.
    """
    return check_fixed_sizes(name, num_ranks, num_microbatches, virtual_stages, 1)


def check_fixed_sizes(name: str, num_ranks, num_microbatches, virtual_stages, per_rank: int) -> tuple[int, int]:
    """(p, m) for a schedule with a fixed number of stages per rank: 1 (contiguous) or 2 (a V).

    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != per_rank`` (names it).
    """
    p = check_positive("num_ranks", num_ranks)
    m = check_positive("num_microbatches", num_microbatches)
    if isinstance(virtual_stages, bool) or virtual_stages != per_rank:  # True == 1: a bool is not a count
        layout, other = ("one stage per rank", "v > 1") if per_rank == 1 else \
            ("exactly two stages per rank in a V", "other counts")
        raise ScheduleArgumentError(
            f"virtual_stages={virtual_stages!r}: {name} places {layout}, so virtual_stages must be {per_rank} "
            f"(use interleaved-1f1b for {other})", argument="virtual_stages"
        )
    return p, m


def forward(stage: int, microbatch: int) -> Instr:
    """``F(stage, microbatch)``; the builders pass indices >= 0, so it skips the checks of ``Instr(...)``."""
    return Instr.trusted(Op.F, stage, microbatch)


def backward(stage: int, microbatch: int) -> Instr:
    """``B(stage, microbatch)``, made like :func:`forward`."""
    return Instr.trusted(Op.B, stage, microbatch)


def program(name: str, streams, stage_to_rank, num_microbatches: int, virtual_stages: int = 1) -> Program:
    """Assemble a compute-only program (no SEND/RECV yet; :mod:`pipesched.lower` adds them)."""
    return Program(
        ranks=tuple(tuple(s) for s in streams),
        stage_to_rank=tuple(stage_to_rank),
        num_microbatches=num_microbatches,
        schedule=name,
        meta={"virtual_stages": virtual_stages},
    )
