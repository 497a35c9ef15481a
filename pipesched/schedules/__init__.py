"""The registry of named schedules: name -> builder of a compute-only program, with its description."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

from ..errors import UnknownScheduleError
from ..ir import Program
from .gpipe import build_gpipe
from .interleaved import build_interleaved_1f1b
from .one_f_one_b import build_1f1b


@dataclass(frozen=True)
class ScheduleInfo:
    """A registered schedule.

    Attributes:
        name: registry name.
        build: ``build(num_ranks, num_microbatches, virtual_stages) -> Program`` (compute-only).
        summary: one line for ``pipesched list``.
        paper: where it comes from.
        default_virtual_stages: v used when the caller gives none.
        bubble: closed-form bubble fraction with uniform costs.
        inflight: closed-form peak in-flight activations on rank r.
        microbatches: which m it accepts.
    """

    name: str
    build: Callable[..., Program]
    summary: str
    paper: str
    default_virtual_stages: int
    bubble: str
    inflight: str
    microbatches: str


SCHEDULES = MappingProxyType({
    info.name: info
    for info in (
        ScheduleInfo("gpipe", build_gpipe, "all forwards, then all backwards", "GPipe, arXiv:1811.06965", 1,
                     "(p-1)/(m+p-1)", "m", "any m >= 1"),
        ScheduleInfo("1f1b", build_1f1b, "warmup, then one forward one backward: GPipe's bubble, less memory",
                     "PipeDream-Flush, arXiv:2006.09503", 1, "(p-1)/(m+p-1)", "min(p-r, m)",
                     "any m >= 1 (m < p runs GPipe-like)"),
        ScheduleInfo("interleaved-1f1b", build_interleaved_1f1b,
                     "v chunks per rank on a looped placement: the bubble shrinks by v",
                     "Megatron-LM interleaved, arXiv:2104.04473", 2, "(p-1)/(v*m+p-1) for m % p == 0",
                     "(v-1)*p + 2(p-1-r) + 1, capped at v*m", "any m >= 1 (Megatron/PyTorch restrict it)"),
    )
})


def get_schedule(name: str) -> ScheduleInfo:
    """The registered schedule ``name``.

    Raises:
        UnknownScheduleError: no such name; the message lists the valid names.
    """
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise UnknownScheduleError(
            f"unknown schedule {name!r}; valid names: {', '.join(sorted(SCHEDULES))}"
        ) from None
