"""The planner: from a :class:`~pipesched.profile.LayerProfile`, the world size, a memory budget per rank and the
global batch, the pipeline configurations that fit, ranked by simulated step time. Torch-free.

Searched: pp x dp = world size (pp <= layers; dp dividing the global batch), every schedule asked for, the
virtual stages each accepts, m with global_batch divisible by dp x m (microbatches of global_batch / (dp x m)
samples, the profile scaled to them), split backward (for schedules with a fused B), the balance (the cut that
minimises the slowest rank, :func:`pipesched.partition.balance_by_time` for the schedule's placement; with several
stages per rank also the one that minimises the slowest stage; the even one), and the least per-stage recompute that fits the budget. Left out as dominated by construction: v > 1 and split backward on one
pipeline rank (pp = 1: the same work in more calls, no bubble to hide; :meth:`~pipesched.plan_search.Search.configs`).
Time per microbatch: the profile scaled affinely (:meth:`~pipesched.profile.LayerProfile.scaled`: each layer's
fixed seconds plus the rest in proportion to the samples). Memory per rank = parameters + gradients + optimizer state
(``optimizer_states`` x parameter bytes) + the peak activation bytes :func:`pipesched.simulate` gives.

How it stays fast (1024 ranks, 96 layers: about 2 s): no configuration is simulated before it is bounded.
Each configuration (everything but recompute) gets, in closed form, a lower bound on its step time
(:func:`~pipesched.plan_bounds.step_time_bound`: per rank, the forwards before its first stage + its work + the
backward chain below it or an all-reduce; valid for any schedule and recompute choice) and on its peak memory
(parameters + gradients + optimizer state + one microbatch of its largest stash). Configurations whose memory bound
exceeds the budget are dropped; the others are simulated in order of their time bound, and the search stops at the
first whose bound exceeds the ``top``-th best simulated step time, so its cost grows with the number simulated, not
with the size of the space. The recompute choice is made on the compute order alone (exact activation peaks
per choice, no simulation); m is capped (``max_microbatches``). Programs are compiled once per configuration.

What it returns (:class:`Candidate`, :class:`Plan`, :class:`PlanError`) is in :mod:`pipesched.plan_result`, importable
from here too.
"""
from __future__ import annotations

import math

from .checks import as_int, check_positive, check_program_size
from .gcpause import paused_gc
from .partition import balance_by_time
from .plan_args import (check_args, check_model, check_recompute, check_split_backward, nothing_runs, schedule_names,
                        virtual_stage_choices)
from .plan_result import Candidate, Plan, PlanError
from .plan_search import Evaluated, Search, best_first, even, smallest_fit, time_key
from .errors import ScheduleArgumentError, UnknownScheduleError
from .registry import get_schedule
from .schedules.zb_auto import NAME as ZB_AUTO, default_memory_limit


@paused_gc()
def plan(profile, world_size: int, memory_per_rank: float, global_batch: int, schedules=None, top: int = 5,
         optimizer_states: float = 2.0, max_microbatches: int | None = None, virtual_stages=None,
         split_backward: bool | None = None, num_layers: int | None = None, layer_names=None) -> Plan:
    """Plan a pipeline for ``profile``'s model: the ``top`` fastest configurations that fit (see the module).

    Args:
        profile: a :class:`~pipesched.profile.LayerProfile` (per-layer seconds and bytes of one microbatch).
        world_size: ranks in all, pp x dp, >= 1.
        memory_per_rank: bytes each rank may hold (parameters, gradients, optimizer state, activations), > 0.
        global_batch: samples per optimizer step over all replicas; dp x m must divide it.
        schedules: names to search (registered ones too); ``None``: :data:`pipesched.plan_args.DEFAULT_SCHEDULES`.
        top: candidates to return, >= 1.
        optimizer_states: optimizer state bytes per parameter byte (AdamW: 2, its two moments; SGD with momentum:
            1; SGD: 0).
        max_microbatches: the largest m tried; ``None``: max(8, 4 x pp), at most 256.
        virtual_stages: the v tried for schedules that take any (interleaved): an integer >= 1 or a sequence of
            them; ``None``: (2, 4). Fixed ones use theirs; v = 1 is the other schedules' (with only v = 1 and
            ``schedules=None``, interleaved ones are left out).
        split_backward: ``None`` tries both for schedules with a fused backward; True/False only that.
        num_layers, layer_names: the model's, when known (either or both; ``layer_names`` alone gives the count):
            a profile of another model is refused.
    Returns:
        A :class:`Plan`, deterministic for a given profile and arguments.
    Raises:
        ValueError: a bad argument (names it, its value and what is valid; ``argument``: its name): world_size
            < 1, a global_batch no dp x m divides (none of pp x dp = world_size has dp dividing it), an unknown or
            empty ``schedules``, a bad ``virtual_stages`` (not integers >= 1, only v = 1 for a schedule that runs
            v >= 2, v above the layer count), a profile of another model (``num_layers`` or ``layer_names``
            differ), ``split_backward`` not None or a bool.
        PlanError: no configuration fits ``memory_per_rank`` (names the smallest budget that fits and its plan).
    """
    world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches = check_args(
        profile, world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches)
    check_model(profile, num_layers, layer_names)
    check_split_backward(split_backward, none_ok=True)
    names = schedule_names(schedules)
    names, vs = virtual_stage_choices(virtual_stages, names, schedules is None, profile.num_layers)
    search = Search(profile, world_size, global_batch, names, optimizer_states, max_microbatches, vs,
                    split_backward, balance_by_time)
    configs = list(search.configs())
    if not configs:
        nothing_runs(search, names, vs)
    ranked = [search.confirm(e) for e in best_first(search, configs, float(memory_per_rank), top)]
    ranked = sorted((e for e in ranked if max(e.peak_memory) <= memory_per_rank), key=lambda e: e.rank_key)
    if not ranked:
        _no_fit(search, configs, memory_per_rank)
    candidates = tuple(_candidate(e, search, profile.layer_names) for e in ranked)
    return Plan(candidates, _reason(candidates, search), world_size, float(memory_per_rank), global_batch,
                profile.num_layers, tuple(profile.layer_names), search.simulated, search.considered)


def predict(profile, global_batch: int, schedule: str, pp: int, dp: int = 1, num_microbatches: int = 8,
            virtual_stages: int | None = None, balance=None, recompute=False, split_backward: bool = False,
            optimizer_states: float = 2.0) -> Candidate:
    """Simulate one configuration as the planner would (e.g. the default ``1f1b``, m=8, even balance, to compare
    with a plan). ``balance=None``: even by layer count (as ``Pipeline(balance=None)``); ``recompute``: a bool or
    one per stage.

    Raises:
        ValueError (ScheduleArgumentError, ``argument`` names it): sizes that are not integers >= 1, more stages
            (pp x v) than the profile's layers, sizes the schedule cannot run, a global_batch dp x m does not
            divide, a ``balance`` not of pp x v stages, a ``recompute`` that is not a bool or one bool per stage
            (as :func:`pipesched.compile_program`: ``"no"``, ``1``, ``[0, 1]`` are refused), a ``split_backward``
            that is not a bool, an unknown schedule.
    """
    _, _, global_batch, _, optimizer_states, _ = check_args(profile, 1, 1.0, global_batch, 1, optimizer_states, None)
    pp, dp, num_microbatches = (check_positive(name, value) for name, value in
                                (("pp", pp), ("dp", dp), ("num_microbatches", num_microbatches)))
    try:
        info = get_schedule(schedule)
    except UnknownScheduleError as exc:
        raise ScheduleArgumentError(f"schedule: {exc.args[0]}", argument="schedule") from None
    v = info.default_virtual_stages if virtual_stages is None else check_positive("virtual_stages", virtual_stages)
    check_program_size(pp, num_microbatches, v, names=("pp", "num_microbatches", "virtual_stages"))
    L, S = profile.num_layers, pp * v
    if S > L:
        raise ScheduleArgumentError(f"pp={pp} x virtual_stages={v} = {S} stages but the profile has {L} layers "
                                    f"(each stage needs one): give pp x virtual_stages <= {L}", argument="pp")
    if global_batch % (dp * num_microbatches):
        raise ScheduleArgumentError(f"global_batch={global_batch} is not divisible by dp x num_microbatches = "
                                    f"{dp * num_microbatches}", argument="global_batch")
    search = Search(profile, pp * dp, global_batch, (schedule,), optimizer_states, num_microbatches, (v,),
                    split_backward, balance_by_time)
    shape = search.shape(schedule, pp, v)
    if shape is None:
        raise ScheduleArgumentError(f"schedule {schedule!r} cannot run pp={pp} with virtual_stages={v}",
                                    argument="virtual_stages" if virtual_stages is not None else "pp")
    balance = tuple(b if as_int(b) is None else as_int(b) for b in (even(L, S) if balance is None else balance))
    if len(balance) != S or sum(balance) != L:
        raise ScheduleArgumentError(f"balance={list(balance)} must be pp x virtual_stages = {pp} x {v} = {S} layer "
                                    f"counts summing to the profile's {L} layers", argument="balance")
    check_split_backward(split_backward, none_ok=False)
    flags = check_recompute(recompute, S)
    config = search.make_config(schedule, pp, dp, num_microbatches, v, split_backward or shape[2], balance, shape[0],
                            split_backward)
    return _candidate(search.confirm(search.evaluate(config, math.inf, flags)), search, profile.layer_names)


def pipeline_kwargs(plan_or_candidate, num_layers: int, world_size: int, layer_names=None, extra=None) -> dict:
    """The ``Pipeline`` arguments (schedule, num_microbatches, virtual_stages, balance, recompute, split_backward,
    dp_size) of a :class:`Plan`'s winner or a :class:`Candidate`, checked against the model and the job, merged with
    the caller's other arguments ``extra`` (``Pipeline.from_plan``'s ``**kwargs``: loss_fn, device, timeout, ...).
    For a schedule built from costs (``zb-auto``) also ``costs`` (:attr:`Candidate.costs`, what the plan simulated
    it with) and ``memory_limit`` (the in-flight limit the plan built it for, ``min(pp, m)`` per rank), so the
    pipeline compiles the plan's program rather than one from the costs its first step measures (a candidate read
    from JSON carries them too; one without them (written by an older pipesched): only ``memory_limit``, and the runtime
    measures the costs).

    Raises:
        TypeError: not a Plan or Candidate. ValueError: the model has another layer count (or layer classes) than
            the plan's, the job another world size than pp x dp (names both and what to do), or ``extra`` sets an
            argument the plan decides (names it).
    """
    planned = _planned_kwargs(plan_or_candidate, num_layers, world_size, layer_names)
    clash = sorted(set(planned) & set(extra or {}))
    if clash:
        shown = ("the CostModel the plan simulated it with: candidate.costs" if clash[0] == "costs"
                 else repr(planned[clash[0]]))  # a CostModel's repr runs to hundreds of characters
        raise ValueError(f"Pipeline.from_plan: {', '.join(clash)} {'is' if len(clash) == 1 else 'are'} decided by the plan ({clash[0]}={shown}); "
                         f"leave it out, or build Pipeline(...) yourself")
    return {**planned, **(extra or {})}


def _planned_kwargs(plan_or_candidate, num_layers: int, world_size: int, layer_names=None) -> dict:
    if isinstance(plan_or_candidate, Plan):
        candidate = plan_or_candidate.best
        names = plan_or_candidate.layer_names or candidate.layer_names
    elif isinstance(plan_or_candidate, Candidate):
        candidate, names = plan_or_candidate, plan_or_candidate.layer_names
    else:
        raise TypeError(f"plan must be a pipesched.Plan or Candidate, got {type(plan_or_candidate).__name__}")
    if sum(candidate.balance) != num_layers:
        raise ValueError(f"the plan is for a model of {sum(candidate.balance)} layers but this model has "
                         f"{num_layers}: plan with a profile of this model (pipesched.runtime.profile_layers)")
    if layer_names is not None and len(layer_names) != num_layers:
        raise ValueError(f"layer_names has {len(layer_names)} names but num_layers={num_layers}: give one class "
                         f"name per layer")
    if names and layer_names and tuple(layer_names) != tuple(names):
        i = next(i for i, (a, b) in enumerate(zip(layer_names, names)) if a != b)
        raise ValueError(f"the plan's layer {i} is a {names[i]} but the model's is a {layer_names[i]}: the plan is "
                         f"for another model")
    if world_size != candidate.pp * candidate.dp:
        raise ValueError(f"the plan needs world size pp x dp = {candidate.pp} x {candidate.dp} = "
                         f"{candidate.pp * candidate.dp} but the job has {world_size} ranks: launch "
                         f"{candidate.pp * candidate.dp} ranks, or plan for world_size={world_size}")
    return {"schedule": candidate.schedule, "num_microbatches": candidate.num_microbatches,
            "virtual_stages": candidate.virtual_stages, "balance": list(candidate.balance),
            "recompute": list(candidate.recompute) if any(candidate.recompute) else False,
            "split_backward": candidate.split_backward, "dp_size": candidate.dp, **_built_from_costs(candidate)}


def _built_from_costs(candidate: Candidate) -> dict:
    """``costs`` (when known) and ``memory_limit`` of a ``zb-auto`` candidate, as the plan built it (the default
    limit: the planner passes none); nothing for other schedules (they refuse both)."""
    if candidate.schedule != ZB_AUTO:
        return {}
    limit = {"memory_limit": list(default_memory_limit(candidate.pp, candidate.num_microbatches))}
    return limit if candidate.costs is None else {"costs": candidate.costs, **limit}


def _candidate(e: Evaluated, search: Search, layer_names=()) -> Candidate:
    """The :class:`Candidate` of a confirmed result, with the :class:`~pipesched.CostModel` it was simulated with."""
    c, global_batch = e.config, search.global_batch
    costs = search.scaled_costs(c.balance, c.dp, c.num_microbatches)
    return Candidate(c.schedule, c.pp, c.dp, c.num_microbatches, c.virtual_stages, c.balance, e.recompute,
                     c.split_backward, e.step_time, e.bubble_fraction, e.peak_memory,
                     global_batch // (c.dp * c.num_microbatches), e.timeline, tuple(layer_names), costs)


def _reason(candidates, search: Search) -> str:
    win = candidates[0]
    line = (f"{win.describe()}: fastest predicted step ({win.step_time:.4g} s, bubble {win.bubble_fraction:.1%}, "
            f"peak {format_bytes(max(win.peak_memory))}) of {search.simulated} configurations simulated "
            f"({search.considered} bounded)")
    if len(candidates) > 1:
        line += "; " + _versus(win, candidates[1])
    return line


def _versus(win: Candidate, other: Candidate) -> str:
    """``"1.2% ahead of <other>"`` or, equal as ranked (:func:`~pipesched.plan_search.time_key`), ``"ties with
    <other>"`` and what broke the tie; then what tells them apart when their descriptions read the same."""
    a, b = win.step_time, other.step_time
    tie = time_key(a) == time_key(b)
    if tie:
        text = f"ties with {other.describe()}"
    else:
        gap = b / a - 1 if a > 0 else math.inf
        text = f"{gap:.1%}" if gap >= 1e-3 else f"{gap * 100:.2g}%"
        text += f" ahead of {other.describe()}"
    differs = []
    if win.describe() == other.describe():
        if win.balance != other.balance:
            differs.append(f"balance {','.join(map(str, other.balance))} against the winner's "
                           f"{','.join(map(str, win.balance))}")
        if win.recompute != other.recompute:
            differs.append(f"recompute stages {[s for s, r in enumerate(other.recompute) if r]} against the "
                           f"winner's {[s for s, r in enumerate(win.recompute) if r]}")
    if tie and max(other.peak_memory) != max(win.peak_memory):
        differs.append(f"peak {format_bytes(max(other.peak_memory))} against the winner's "
                       f"{format_bytes(max(win.peak_memory))}")
    return text + (f" ({'; '.join(differs)})" if differs else "")


def _no_fit(search: Search, configs, memory_per_rank) -> None:
    need, config = smallest_fit(search, configs)
    S = len(config.stage_to_rank)
    flags = tuple(True for _ in range(S))
    e = search.confirm(search.evaluate(config, math.inf, flags))
    candidate = _candidate(e, search, search.profile.layer_names)
    raise PlanError(f"memory_per_rank={format_bytes(memory_per_rank)}: no configuration fits; the smallest memory "
                    f"per rank that fits is {format_bytes(need)} ({int(math.ceil(need))} bytes) against "
                    f"{_byte_count(memory_per_rank)} bytes given, with {candidate.describe()} (every stage "
                    f"recomputed)", need, candidate)


def _byte_count(n: float) -> str:
    """A byte count in full: ``10485759`` (a whole number of bytes, as an int), ``1.5`` otherwise."""
    return str(int(n)) if float(n).is_integer() else repr(float(n))


def format_bytes(n: float) -> str:
    """``17179869184`` -> ``"16 GiB"``, ``1044480`` -> ``"1020 KiB"`` (3 significant digits, whole numbers from
    100 up, never an exponent; B, KiB, MiB, GiB, TiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size * (1 - 0.5 / 1024):  # 1023.5 KiB and up is 1 MiB, not 1024 KiB
            value = n / size
            return f"{value:.0f} {unit}" if value >= 99.95 else f"{value:.3g} {unit}"
    return f"{n:.0f} B"
