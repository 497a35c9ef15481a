"""The planner's argument checks (:func:`pipesched.plan`, :func:`pipesched.planner.predict`): each bad argument is
a ``ScheduleArgumentError`` (a ``ValueError``) naming it, its value and what is valid, before any search. Torch-free.
"""
from __future__ import annotations

import math

from . import lower
from .checks import as_int, check_positive, check_program_size, described, is_real, plain_number
from .errors import ScheduleArgumentError, UnknownScheduleError
from .plan_search import Search
from .registry import get_schedule
from .schedules import SCHEDULES

#: schedules searched when ``schedules`` is None: the built-ins but ``zb-auto`` (its builder itself searches
#: with the simulator, ~10x slower to build; name it to include it)
DEFAULT_SCHEDULES = tuple(name for name in SCHEDULES if name != "zb-auto")
#: virtual stages tried for schedules that take any (interleaved) when ``virtual_stages`` is None
DEFAULT_VIRTUAL_STAGES = (2, 4)


def check_args(profile, world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches):
    """``(world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches)`` checked, as plain
    ints and numbers (numpy's are accepted: none reaches a plan or its JSON); the callers use these."""
    from .profile import LayerProfile

    if not isinstance(profile, LayerProfile):
        raise TypeError(f"profile must be a pipesched.LayerProfile, got {type(profile).__name__}")
    world_size = check_positive("world_size", world_size)
    global_batch = check_positive("global_batch", global_batch)
    top = check_positive("top", top)
    if max_microbatches is not None:
        max_microbatches = check_positive("max_microbatches", max_microbatches)
        # the search tries every m up to it: refused past what one rank's program may hold (else it never ends)
        check_program_size(1, max_microbatches, 1, names=("pp", "max_microbatches", "virtual_stages"))
    memory_per_rank, optimizer_states = _plain_number(memory_per_rank), _plain_number(optimizer_states)
    if isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, (int, float)) \
            or not 0 < memory_per_rank < math.inf:
        raise ScheduleArgumentError(f"memory_per_rank must be a number of bytes > 0, got {memory_per_rank!r}",
                                    argument="memory_per_rank")
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, (int, float)) \
            or not 0 <= optimizer_states < math.inf:
        raise ScheduleArgumentError(f"optimizer_states must be a number >= 0 (optimizer state bytes per parameter "
                                    f"byte; AdamW: 2), got {optimizer_states!r}", argument="optimizer_states")
    return world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches


def check_split_backward(value, none_ok: bool) -> None:
    """``split_backward`` a bool (or None where ``none_ok``: :func:`pipesched.plan` tries both), not read by
    truthiness (``"no"`` would split)."""
    if isinstance(value, bool) or (none_ok and value is None):
        return
    valid = "None (try both), True or False" if none_ok else "True or False"
    raise ScheduleArgumentError(f"split_backward must be {valid}, got {described(value)}", argument="split_backward")


def check_recompute(value, num_stages: int) -> tuple[bool, ...]:
    """``recompute`` as one bool per stage: a bool or a sequence of bools, checked as :func:`pipesched.compile_program`
    checks it (:func:`pipesched.lower.stage_flags`: ``"no"``, ``1``, ``[0, 1]`` refused), then its length."""
    sized = not isinstance(value, (bool, str, bytes)) and hasattr(value, "__len__")
    try:
        flags = lower.stage_flags(value, len(value) if sized else num_stages, "recompute")
    except ValueError as exc:
        raise ScheduleArgumentError(str(exc), argument="recompute") from None
    if len(flags) != num_stages:
        raise ScheduleArgumentError(f"recompute={flags} has {len(flags)} flags but there are {num_stages} stages: "
                                    f"give a bool or one per stage", argument="recompute")
    return tuple(flags)


def _plain_number(value):
    """A numpy integer as a plain int, any other real number (``np.float32`` too; not a bool) as a plain float;
    anything else as it is (checked after)."""
    return plain_number(value) if is_real(value) else value


def schedule_names(schedules) -> tuple[str, ...]:
    if schedules is None:
        return DEFAULT_SCHEDULES
    try:
        names = (schedules,) if isinstance(schedules, str) else tuple(schedules)
    except TypeError:
        names = (schedules,)
    if not names or not all(isinstance(name, str) for name in names):
        raise ScheduleArgumentError(f"schedules must name at least one schedule (a name or a list of names; None: "
                                    f"the built-ins but zb-auto), got {schedules!r}", argument="schedules")
    for name in names:
        try:
            get_schedule(name)
        except UnknownScheduleError as exc:
            raise ScheduleArgumentError(f"schedules: {exc.args[0]}", argument="schedules") from None
    return tuple(dict.fromkeys(names))


def check_model(profile, num_layers, layer_names) -> None:
    """``num_layers`` and/or ``layer_names`` against the profile (``layer_names`` alone: its length is the count)."""
    if num_layers is not None:  # "8" or -1 was reported as "the profile is of another model"
        num_layers = check_positive("num_layers", num_layers)
    if layer_names is not None:
        if isinstance(layer_names, str) or not all(isinstance(n, str) for n in layer_names):
            raise ScheduleArgumentError(f"layer_names must be a list of layer class names, got {layer_names!r}",
                                        argument="layer_names")
        layer_names = tuple(layer_names)
        if num_layers is not None and num_layers != len(layer_names):
            raise ScheduleArgumentError(f"layer_names has {len(layer_names)} names but num_layers={num_layers}: "
                                        f"give one class name per layer", argument="layer_names")
    if num_layers is None and layer_names is None:
        return
    try:
        profile.check_model(len(layer_names) if num_layers is None else num_layers, layer_names)
    except ValueError as exc:
        argument = "num_layers" if num_layers is not None and num_layers != profile.num_layers else "layer_names"
        raise ScheduleArgumentError(f"{argument}: {exc}", argument=argument) from None


def virtual_stage_choices(value, names: tuple[str, ...], by_default: bool, num_layers: int):
    """``(schedules, virtual stages)`` to search, or a ValueError naming ``virtual_stages``: not integers >= 1, v = 1
    only for a schedule that runs v >= 2 (named; left out instead when it is searched only by default), or a v
    whose pp x v exceeds the layers for every pp (v > layers: pp = 1 is the least)."""
    if value is None:
        return names, DEFAULT_VIRTUAL_STAGES
    values = (value,) if as_int(value) is not None else value
    try:
        values = tuple(values)
    except TypeError:
        values = ()
    if not isinstance(value, (str, bytes)) and all(as_int(v) is not None for v in values):
        values = tuple(map(as_int, values))  # plain ints (numpy's accepted)
    if isinstance(value, (str, bytes)) or not values \
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ScheduleArgumentError(f"virtual_stages must be an integer >= 1 or a non-empty sequence of them "
                                    f"(e.g. 2 or (2, 4)), got {value!r}", argument="virtual_stages")
    takes = [n for n in names if get_schedule(n).default_virtual_stages > 1
             and not get_schedule(n).fixed_virtual_stages]
    if not takes:  # each runs its own v (fixed: zbv's 2; the plain ones 1): one of them must be a v asked for
        runs = {n: get_schedule(n).default_virtual_stages for n in names}
        if not set(runs.values()) & set(values):
            raise ScheduleArgumentError(
                f"virtual_stages={value!r}: no schedule asked for runs it: " + ", ".join(
                    f"{n!r} runs {'exactly ' if v > 1 else ''}v = {v}" for n, v in runs.items())
                + " stages per rank; leave virtual_stages out, or name a schedule that takes any v "
                "(interleaved-1f1b)", argument="virtual_stages")
        return names, values
    runs_one = any(get_schedule(n).default_virtual_stages == 1 for n in names)
    usable = tuple(dict.fromkeys(v for v in values if v > 1))
    if not usable or (1 in values and not runs_one):
        if not usable and runs_one and by_default:
            return tuple(n for n in names if n not in takes), values  # v = 1 asked: the plain schedules only
        raise ScheduleArgumentError(
            f"virtual_stages={value!r}: v = 1 is asked for but schedule {', '.join(map(repr, takes))} runs v >= 2 "
            f"stages per rank (v = 1 is another schedule's program, e.g. 1f1b): give virtual_stages >= 2, e.g. "
            f"(2, 4), or leave it out of schedules", argument="virtual_stages")
    over = [v for v in usable if v > num_layers]
    if over:
        raise ScheduleArgumentError(
            f"virtual_stages={value!r}: v={over[0]} stages per rank need pp x {over[0]} >= {over[0]} layers for "
            f"every pp, but the model has {num_layers} (schedule {', '.join(map(repr, takes))}): give virtual stages "
            f"<= {num_layers}",
            argument="virtual_stages")
    return names, usable


def nothing_runs(search: Search, names, virtual_stages) -> None:
    """No configuration at all: the global batch (no dp divides it), or the schedules (none runs a pp left)."""
    world, L, batch = search.world_size, search.profile.num_layers, search.global_batch
    pps = [pp for pp in range(1, min(world, L) + 1) if world % pp == 0 and batch % (world // pp) == 0]
    if not pps:
        raise ScheduleArgumentError(
            f"global_batch={batch}: no dp x m divides it for world_size={world} (pp x dp = world_size with pp <= "
            f"{L} layers, dp dividing global_batch and schedules {list(names)} running pp): give a global batch "
            f"divisible by {_smallest_dp(world, L)}", argument="global_batch")
    raise ScheduleArgumentError(
        f"schedules {list(names)} run none of pp = {', '.join(map(str, pps))} (pp x dp = world_size={world}, dp "
        f"dividing global_batch={batch}, pp x v <= {L} layers, v in virtual_stages={list(virtual_stages)} where "
        f"a schedule takes any): search other schedules, or another world_size or global_batch",
        argument="schedules")


def _smallest_dp(world_size: int, num_layers: int) -> int:
    return min(world_size // pp for pp in range(1, min(world_size, num_layers) + 1) if world_size % pp == 0)
