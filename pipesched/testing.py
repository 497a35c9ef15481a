"""Hypothesis strategies and checks for property-testing schedules — the built-in ones or your own.

Needs the ``test`` extra (``pip install pipesched[test]``). Example, for your own builder
``my_schedule(p, m) -> Program`` (compute-only)::

    from hypothesis import given, strategies as st
    from pipesched.testing import check_program
    from pipesched.lower import add_send_recv

    @given(st.integers(1, 16), st.integers(1, 64))
    def test_my_schedule(p, m):
        check_program(add_send_recv(my_schedule(p, m)))
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:  # the test extra is not installed
    if exc.name != "hypothesis":
        raise
    raise ModuleNotFoundError("pipesched.testing needs hypothesis, which is not installed: "
                              "pip install 'pipesched[test]' (or pip install hypothesis)", name="hypothesis") from None

from . import program_io
from .api import compile_program
from .checks import as_int, check_flag, described
from .cost import CostModel
from .ir import Program
from .registry import get_schedule
from .schedules import SCHEDULES
from .sim import simulate
from .validate import validate

__all__ = ["check_program", "cost_models", "schedule_configs"]


@dataclass(frozen=True)
class ScheduleConfig:
    """Sizes that pick one compiled program: schedule name, ranks p, microbatches m, virtual stages v, dp."""

    schedule: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    dp_size: int = 1
    recompute: bool = False

    def compile(self) -> Program:
        return compile_program(self.schedule, self.num_ranks, self.num_microbatches, self.virtual_stages,
                               dp_size=self.dp_size, recompute=self.recompute)


def schedule_configs(names=None, max_ranks: int = 16, max_microbatches: int = 64, max_virtual_stages: int = 4,
                     max_dp: int = 4, recompute: bool | None = None):
    """Strategy of :class:`ScheduleConfig` over the built-in schedules (or ``names``, which may name registered ones).

    ``names``: a list (any iterable but a string) of schedule names; names unknown when a config is drawn raise
    ``UnknownScheduleError`` then (a schedule may be registered after the strategy is made).
    ``num_ranks`` is drawn in 1..max_ranks, ``num_microbatches`` in 1..max_microbatches, ``dp_size`` in 1..max_dp;
    ``virtual_stages`` in 1..max_virtual_stages for schedules whose default is > 1, else it is the
    default (also for a schedule with ``fixed_virtual_stages``, e.g. ``zbv``: 2).
    ``recompute``: ``None`` draws it, a bool fixes it.

    Raises (when called, not when drawn):
        TypeError: ``names`` a string or not an iterable of strings, a ``max_*`` not an integer (a bool is not),
            ``recompute`` not ``None`` or a bool.
        ValueError: ``names`` empty, a ``max_*`` below 1.
    """
    where = "schedule_configs: "
    if names is not None:
        if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
            hint = f" (for one schedule: names=[{names!r}])" if isinstance(names, str) else ""
            raise TypeError(f"{where}names must be None (every built-in schedule) or a list of schedule names, got "
                            f"{described(names)}{hint}")
        names = tuple(names)
        bad = next((n for n in names if not isinstance(n, str)), None)
        if bad is not None:
            raise TypeError(f"{where}names must hold schedule names (str), got {described(bad)} in {names!r}")
        if not names:
            raise ValueError(f"{where}names is empty: give at least one schedule name, or None for every built-in "
                             f"schedule")
    sizes = {}
    for name, value in (("max_ranks", max_ranks), ("max_microbatches", max_microbatches),
                        ("max_virtual_stages", max_virtual_stages), ("max_dp", max_dp)):
        sizes[name] = _at_least_one(value, name, where)
    check_flag(recompute, "recompute", where=where, none="drawn")
    return _schedule_configs(tuple(sorted(names or SCHEDULES)), recompute=recompute, **sizes)


def _at_least_one(value, name: str, where: str) -> int:
    number = as_int(value)
    if number is None:
        kind = " (a bool is not a count)" if isinstance(value, bool) else ""
        raise TypeError(f"{where}{name} must be an integer >= 1, got {described(value)}{kind}")
    if number < 1:
        raise ValueError(f"{where}{name} must be an integer >= 1, got {value!r}")
    return number


def _draw_config(draw, names: tuple[str, ...], max_ranks: int, max_microbatches: int, max_virtual_stages: int,
                 max_dp: int, recompute: bool | None):
    for known in names:  # each, not only the one drawn: a typo among several is told at the first draw
        get_schedule(known)  # a built-in or a registered user schedule
    name = draw(st.sampled_from(names))
    info = get_schedule(name)
    multi = info.default_virtual_stages > 1 and not info.fixed_virtual_stages
    return ScheduleConfig(
        schedule=name,
        num_ranks=draw(st.integers(1, max_ranks)),
        num_microbatches=draw(st.integers(1, max_microbatches)),
        virtual_stages=draw(st.integers(1, max_virtual_stages)) if multi else info.default_virtual_stages,
        dp_size=draw(st.integers(1, max_dp)),
        recompute=draw(st.booleans()) if recompute is None else recompute,
    )


def _composite(draw_function, public_name: str):
    """``st.composite(draw_function)``, shown in reprs (hypothesis's messages) under the public name."""
    draw_function.__name__ = draw_function.__qualname__ = public_name
    return st.composite(draw_function)


_schedule_configs = _composite(_draw_config, "schedule_configs")


def _per_stage(num_stages: int, low: float, high: float):
    return st.lists(st.floats(low, high, allow_nan=False), min_size=num_stages, max_size=num_stages)


def cost_models(num_stages: int, uniform: bool = False, with_comm: bool = True):
    """Strategy of :class:`CostModel` with positive per-stage seconds (0.1 to 10) for ``num_stages`` stages.

    ``uniform``: one forward and one backward cost for every stage (the closed forms' assumption) and
    free messages. ``with_comm``: draw latency, send overhead, bandwidth and activation sizes too.

    Raises (when called, not when drawn):
        TypeError: ``num_stages`` not an integer (a bool is not), ``uniform`` or ``with_comm`` not a bool.
        ValueError: ``num_stages`` below 1.
    """
    where = "cost_models: "
    num_stages = _at_least_one(num_stages, "num_stages", where)
    check_flag(uniform, "uniform", where=where)
    check_flag(with_comm, "with_comm", where=where)
    return _cost_models(num_stages, uniform, with_comm)


def _draw_cost(draw, num_stages: int, uniform: bool, with_comm: bool):
    if uniform:
        return CostModel(forward=draw(st.floats(0.1, 10)), backward=draw(st.floats(0.1, 10)))
    return CostModel(
        forward=draw(_per_stage(num_stages, 0.1, 10)),
        backward=draw(_per_stage(num_stages, 0.1, 10)),
        recompute=draw(_per_stage(num_stages, 0.1, 10)),
        latency=draw(st.floats(0, 1)) if with_comm else 0.0,
        bandwidth=draw(st.floats(1e3, 1e9)) if with_comm else float("inf"),
        activation_bytes=draw(_per_stage(num_stages, 0, 1e6)) if with_comm else 0.0,
        send_overhead=draw(st.floats(0, 0.5)) if with_comm else 0.0,
    )


_cost_models = _composite(_draw_cost, "cost_models")


def check_program(program: Program, cost: CostModel | None = None) -> None:
    """Assert what every runnable program must satisfy: it validates, the simulator completes with every
    instruction timed once and within the makespan, and the text and JSON forms round-trip.

    Raises:
        ScheduleError: the program is invalid.
        AssertionError: a property does not hold (the message says which).
    """
    validate(program)
    timeline = simulate(program, cost, check=False)
    assert len(timeline.events) == len(program), f"simulated {len(timeline.events)} of {len(program)} instructions"
    assert all(e.end >= e.start >= 0 for e in timeline.events), "an event ends before it starts"
    assert 0.0 <= timeline.bubble_fraction <= 1.0, f"bubble fraction {timeline.bubble_fraction} outside [0, 1]"
    assert program_io.loads(program_io.to_text(program)) == program, "text form does not round-trip"
    assert program_io.loads(program_io.to_json(program)) == program, "JSON form does not round-trip"
