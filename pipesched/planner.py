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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .checks import as_int, check_positive, is_real
from .gcpause import paused_gc
from .partition import balance_by_time
from .plan_args import check_args, check_model, nothing_runs, schedule_names, virtual_stage_choices
from .plan_search import Evaluated, Search, best_first, even, smallest_fit
from .errors import ScheduleArgumentError, UnknownScheduleError
from .registry import get_schedule



@dataclass(frozen=True)
class Candidate:
    """One planned configuration, what :meth:`pipesched.runtime.Pipeline.from_plan` builds.

    Attributes:
        schedule, pp, dp, num_microbatches, virtual_stages: the schedule name, pipeline ranks, data-parallel
            replicas (pp x dp = world size), microbatches per step per replica, stages per rank.
        balance: layers per stage (pp x virtual_stages of them).
        recompute: one bool per stage: recompute its activations in backward.
        split_backward: split the fused backward into I and W (``compile_program``'s option).
        step_time: predicted seconds of one training step (the simulated makespan, all-reduce included).
        bubble_fraction: predicted idle rank-seconds / (pp x step time).
        peak_memory: predicted peak bytes per pipeline rank (every replica alike): parameters, gradients,
            optimizer state and the peak activation bytes.
        microbatch_size: samples per microbatch (global batch / (dp x m)).
        timeline: the simulated :class:`~pipesched.Timeline` (not compared, not in the JSON form).
        layer_names: the profiled model's layer class names (``()``: unknown; not compared), so that
            ``Pipeline.from_plan`` refuses a model of other layer classes given a Candidate as given a Plan.

    Raises:
        ValueError: a field of the wrong type or size (names it, its value and what is valid).
    """

    schedule: str
    pp: int
    dp: int
    num_microbatches: int
    virtual_stages: int
    balance: tuple[int, ...]
    recompute: tuple[bool, ...]
    split_backward: bool
    step_time: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]
    microbatch_size: int
    timeline: object = field(default=None, compare=False, repr=False)
    layer_names: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_candidate(self)
        for name in ("pp", "dp", "num_microbatches", "virtual_stages", "microbatch_size"):  # numpy ints: plain
            object.__setattr__(self, name, as_int(getattr(self, name)))
        object.__setattr__(self, "balance", type(self.balance)(as_int(b) for b in self.balance))

    def to_json(self) -> dict:
        """The JSON form (``pipesched plan --json``): ``schedule, pp, dp, num_microbatches, virtual_stages,
        balance, recompute, split_backward, microbatch_size, step_time, bubble_fraction, peak_memory`` (bytes per
        pipeline rank), and ``layer_names`` when the profile has them; :meth:`from_json` reads it back."""
        data = {"schedule": self.schedule, "pp": self.pp, "dp": self.dp, "num_microbatches": self.num_microbatches,
                "virtual_stages": self.virtual_stages, "balance": list(self.balance),
                "recompute": list(self.recompute), "split_backward": self.split_backward,
                "microbatch_size": self.microbatch_size, "step_time": self.step_time,
                "bubble_fraction": self.bubble_fraction, "peak_memory": [int(math.ceil(b)) for b in self.peak_memory]}
        if self.layer_names:
            data["layer_names"] = list(self.layer_names)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Candidate":
        """A candidate from its :meth:`to_json` form (e.g. one entry of ``pipesched plan --json``'s
        ``"candidates"``), for :meth:`pipesched.runtime.Pipeline.from_plan` in a training script (no timeline).

        ``layer_names`` may be absent (JSON of an older pipesched: the model is then checked by layer count only).

        Raises:
            ValueError: a key is missing, or a value has the wrong type or size (names the key, its value and what
                is valid).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a planned candidate is a JSON object (dict), got {type(data).__name__}")
        names = ("schedule", "pp", "dp", "num_microbatches", "virtual_stages", "balance", "recompute",
                 "split_backward", "microbatch_size", "step_time", "bubble_fraction", "peak_memory")
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"a planned candidate needs the keys {list(names)}; missing {missing}")
        values = {n: data[n] for n in names + ("layer_names",) if n in data}
        for n in ("balance", "recompute", "peak_memory", "layer_names"):
            if n in values:
                if not isinstance(values[n], (list, tuple)):
                    raise ValueError(f"candidate field {n!r} must be a list, got {values[n]!r}")
                values[n] = tuple(values[n])
        return cls(**values)

    def describe(self) -> str:
        """One line: schedule, sizes, recompute and split."""
        rec = sum(self.recompute)
        parts = [f"{self.schedule} pp={self.pp} dp={self.dp} m={self.num_microbatches} v={self.virtual_stages}"]
        if rec:
            parts.append(f"recompute {rec}/{len(self.recompute)} stages")
        if self.split_backward:
            parts.append("split backward")
        return ", ".join(parts)


@dataclass(frozen=True)
class Plan:
    """Candidates that fit, best (fastest predicted step) first, and what they were planned for.

    Attributes:
        candidates: :class:`Candidate` s, ranked by step time (ties: lower peak memory, then name and sizes).
        reason: one line on why the winner won.
        world_size, memory_per_rank (bytes), global_batch: the request.
        num_layers, layer_names: the profiled model's (``from_plan`` checks the model against them).
        simulated, considered: configurations simulated and bounded (how much the pruning saved).
    """

    candidates: tuple[Candidate, ...]
    reason: str
    world_size: int
    memory_per_rank: float
    global_batch: int
    num_layers: int
    layer_names: tuple[str, ...] = ()
    simulated: int = 0
    considered: int = 0

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def __iter__(self):
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, index) -> Candidate:
        return self.candidates[index]

    def to_json(self) -> dict:
        """``{"candidates": [Candidate.to_json(), ...]}``, best first."""
        return {"candidates": [c.to_json() for c in self.candidates]}


class PlanError(ValueError):
    """No configuration fits the memory budget. ``smallest``: the fewest bytes per rank that a configuration
    needs (everything recomputed), ``candidate``: that configuration (a :class:`Candidate`, simulated), ``argument``:
    ``"memory_per_rank"``."""

    def __init__(self, message: str, smallest: float, candidate: Candidate) -> None:
        super().__init__(message)
        self.smallest, self.candidate, self.argument = smallest, candidate, "memory_per_rank"


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
            differ).
        PlanError: no configuration fits ``memory_per_rank`` (names the smallest budget that fits and its plan).
    """
    world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches = check_args(
        profile, world_size, memory_per_rank, global_batch, top, optimizer_states, max_microbatches)
    check_model(profile, num_layers, layer_names)
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
    candidates = tuple(_candidate(e, global_batch, profile.layer_names) for e in ranked)
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
            divide, a ``balance`` or ``recompute`` not of pp x v stages, an unknown schedule.
    """
    _, _, global_batch, _, optimizer_states, _ = check_args(profile, 1, 1.0, global_batch, 1, optimizer_states, None)
    pp, dp, num_microbatches = (check_positive(name, value) for name, value in
                                (("pp", pp), ("dp", dp), ("num_microbatches", num_microbatches)))
    try:
        info = get_schedule(schedule)
    except UnknownScheduleError as exc:
        raise ScheduleArgumentError(f"schedule: {exc.args[0]}", argument="schedule") from None
    v = info.default_virtual_stages if virtual_stages is None else check_positive("virtual_stages", virtual_stages)
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
    flags = (bool(recompute),) * S if isinstance(recompute, bool) else tuple(recompute)
    if len(flags) != S:
        raise ScheduleArgumentError(f"recompute={list(flags)} has {len(flags)} flags but there are {S} stages: give "
                                    f"a bool or one per stage", argument="recompute")
    config = search.make_config(schedule, pp, dp, num_microbatches, v, split_backward or shape[2], balance, shape[0],
                            split_backward)
    return _candidate(search.confirm(search.evaluate(config, math.inf, flags)), global_batch, profile.layer_names)


def pipeline_kwargs(plan_or_candidate, num_layers: int, world_size: int, layer_names=None, extra=None) -> dict:
    """The ``Pipeline`` arguments (schedule, num_microbatches, virtual_stages, balance, recompute, split_backward,
    dp_size) of a :class:`Plan`'s winner or a :class:`Candidate`, checked against the model and the job, merged with
    the caller's other arguments ``extra`` (``Pipeline.from_plan``'s ``**kwargs``: loss_fn, device, timeout, ...).

    Raises:
        TypeError: not a Plan or Candidate. ValueError: the model has another layer count (or layer classes) than
            the plan's, the job another world size than pp x dp (names both and what to do), or ``extra`` sets an
            argument the plan decides (names it).
    """
    planned = _planned_kwargs(plan_or_candidate, num_layers, world_size, layer_names)
    clash = sorted(set(planned) & set(extra or {}))
    if clash:
        raise ValueError(f"Pipeline.from_plan: {', '.join(clash)} is decided by the plan ({clash[0]}="
                         f"{planned[clash[0]]!r}); leave it out, or build Pipeline(...) yourself")
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
            "split_backward": candidate.split_backward, "dp_size": candidate.dp}


def _candidate(e: Evaluated, global_batch: int, layer_names=()) -> Candidate:
    c = e.config
    return Candidate(c.schedule, c.pp, c.dp, c.num_microbatches, c.virtual_stages, c.balance, e.recompute,
                     c.split_backward, e.step_time, e.bubble_fraction, e.peak_memory,
                     global_batch // (c.dp * c.num_microbatches), e.timeline, tuple(layer_names))


def _check_candidate(c: Candidate) -> None:
    """Each field's type and the sizes that must agree (a hand-edited or foreign JSON form, ``"pp": "2"``)."""
    def bad(name, what):
        raise ValueError(f"candidate field {name!r} must be {what}, got {getattr(c, name)!r}")

    def integer(x, least):
        return as_int(x) is not None and x >= least

    def number(x):
        return is_real(x) and 0 <= x < math.inf

    if not isinstance(c.schedule, str) or not c.schedule:
        bad("schedule", "a schedule name (a string)")
    for name in ("pp", "dp", "num_microbatches", "virtual_stages", "microbatch_size"):
        if not integer(getattr(c, name), 1):
            bad(name, "an integer >= 1")
    if not isinstance(c.split_backward, bool):
        bad("split_backward", "true or false")
    for name in ("step_time", "bubble_fraction"):
        if not number(getattr(c, name)):
            bad(name, "a number >= 0")
    S = c.pp * c.virtual_stages
    if not isinstance(c.balance, (tuple, list)) or len(c.balance) != S or not all(integer(b, 1) for b in c.balance):
        bad("balance", f"a list of pp x virtual_stages = {S} layer counts >= 1")
    if not isinstance(c.recompute, (tuple, list)) or len(c.recompute) != S \
            or not all(isinstance(r, bool) for r in c.recompute):
        bad("recompute", f"a list of {S} true/false (one per stage)")
    if not isinstance(c.peak_memory, (tuple, list)) or len(c.peak_memory) != c.pp \
            or not all(number(b) for b in c.peak_memory):
        bad("peak_memory", f"a list of pp = {c.pp} byte counts >= 0")
    if not isinstance(c.layer_names, (tuple, list)) or len(c.layer_names) not in (0, sum(c.balance)) \
            or not all(isinstance(n, str) for n in c.layer_names):
        bad("layer_names", f"a list of {sum(c.balance)} layer class names (or empty: unknown)")


def _reason(candidates, search: Search) -> str:
    win = candidates[0]
    line = (f"{win.describe()}: fastest predicted step ({win.step_time:.4g} s, bubble {win.bubble_fraction:.1%}, "
            f"peak {max(win.peak_memory) / 2**30:.3g} GiB) of {search.simulated} configurations simulated "
            f"({search.considered} bounded)")
    if len(candidates) > 1:
        line += "; " + _versus(win, candidates[1])
    return line


def _versus(win: Candidate, other: Candidate) -> str:
    """``"1.2% ahead of <other>"`` or, equal to float rounding (as ranked: 9 significant digits), ``"ties with
    <other>"`` and what broke the tie; then what tells them apart when their descriptions read the same."""
    a, b = win.step_time, other.step_time
    tie = abs(b - a) <= 1e-9 * max(abs(a), abs(b)) or float(f"{a:.9g}") == float(f"{b:.9g}")
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
    candidate = _candidate(e, search.global_batch, search.profile.layer_names)
    raise PlanError(f"memory_per_rank={format_bytes(memory_per_rank)}: no configuration fits; the smallest memory "
                    f"per rank that fits is {format_bytes(need)} ({int(math.ceil(need))} bytes), with "
                    f"{candidate.describe()} (every stage recomputed)", need, candidate)


def format_bytes(n: float) -> str:
    """``17179869184`` -> ``"16 GiB"`` (3 significant digits; B, KiB, MiB, GiB, TiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
