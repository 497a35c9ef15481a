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
from .dualpipe_v import build_dualpipev
from .v_shape import build_zbv
from .zero_bubble import build_zb_h1, build_zb_h2
from .zb_auto import build_zb_auto


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
        fixed_virtual_stages: the schedule runs only ``default_virtual_stages`` (e.g. a V: exactly 2).
        takes_costs: ``build`` also takes ``costs=`` (a :class:`~pipesched.cost.CostModel`) and ``memory_limit=``
            (``zb-auto``); :func:`pipesched.compile_program` passes them to such builders only.
    """

    name: str
    build: Callable[..., Program]
    summary: str
    paper: str
    default_virtual_stages: int
    bubble: str
    inflight: str
    microbatches: str
    fixed_virtual_stages: bool = False
    takes_costs: bool = False


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
        ScheduleInfo("zb-h1", build_zb_h1,
                     "1F1B with split backward, W delayed into the cooldown: a third of its bubble",
                     "Zero Bubble PP (ZB-H1), arXiv:2401.10241", 1, "(p-1)/(3*m+p-1) for m >= p",
                     "min(p, m) (until I: min(p-r, m))", "any m >= 1 (m < p: valid, larger bubble)"),
        ScheduleInfo("zb-h2", build_zb_h2, "extra warmup forwards, W deferred to the tail: hides latency and cheap W",
                     "Zero Bubble PP (ZB-H2), arXiv:2401.10241", 1,
                     "(p-1)/(3*m+p-1) for m >= 2*p-2",
                     "min(m, max(2(p-r)-1, 2r)), at most 2p-1", "any m >= 1 (m < 2p-2: valid, larger bubble)"),
        ScheduleInfo("zbv", build_zbv, "zero bubble on a V placement: two stages per rank, split backward",
                     "ZB-V, Zero Bubble Pipeline Parallelism, arXiv:2401.10241 section 6", 2,
                     "(p-1)/(6*m+p-1) for m >= 2*p-1", "min(2p, 2m, m+r+1)", "any m >= 1 (v must be 2)",
                     fixed_virtual_stages=True),
        ScheduleInfo("dualpipev", build_dualpipev,
                     "V placement, F of one microbatch paired with B of another (meta overlap_pairs)",
                     "DualPipe-V, DeepSeek-V3, arXiv:2412.19437", 2, "(p-1)/(6*m+p-1) for m >= 2*p",
                     "min(2p+1, 2m, m+r+1)", "any m >= 1 (PyTorch: m >= 2p; v must be 2)",
                     fixed_virtual_stages=True),
        ScheduleInfo("zb-auto", build_zb_auto,
                     "built for given costs and a memory limit: greedy F/I/W list schedule, never slower than zb-h1 "
                     "where zb-h1 fits the limit (always at the default)",
                     "Zero Bubble PP automatic scheduling, arXiv:2401.10241 section 4", 1,
                     "<= zb-h1's under the given costs", "<= memory_limit (default min(p, m), zb-h1's)",
                     "any m >= 1", fixed_virtual_stages=True, takes_costs=True),
    )
})


def get_schedule(name: str) -> ScheduleInfo:
    """The built-in schedule ``name`` (:func:`pipesched.get_schedule` also finds user schedules:
    :mod:`pipesched.registry`).

    Raises:
        UnknownScheduleError: no such name; the message lists the valid names.
    """
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise UnknownScheduleError(
            f"unknown schedule {name!r}; valid names: {', '.join(sorted(SCHEDULES))}"
        ) from None
