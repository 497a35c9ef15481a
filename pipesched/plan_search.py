"""The planner's search: enumerate configurations, bound them, simulate the promising ones best-first.

A :class:`Config` is everything but the recompute choice (schedule, pp, dp, m, v, split backward, balance); its
step-time lower bound (:func:`~pipesched.plan_bounds.step_time_bound`) holds for any recompute choice, so
configurations are taken in order of that bound and the search stops as soon as the next bound exceeds the
``top``-th best simulated step time. Every comparison of step times (the stop, the ranking, the dedupe, the plan's
reason) goes through :func:`time_key`, so the winner is the same for every ``top``. Torch-free; used through
:func:`pipesched.plan`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from functools import lru_cache

from . import lower
from .api import build, compile_program
from .errors import ScheduleArgumentError
from .ir import Op
from .plan_bounds import (StageCosts, activation_bound, activation_peak, choose_recompute, compute_order,
                          stage_costs, static_bytes, step_time_bound)
from .registry import get_schedule
from .sim import simulate


#: relative float slack of a step-time bound: its sums run in another order than the simulator's, so a bound may
#: exceed the step time it bounds by a few ulps (far less than this)
BOUND_SLACK = 1e-12


def time_key(seconds: float) -> float:
    """A step time as the planner compares it, everywhere: to 9 significant digits (sums of the same times in
    another order differ in the last bits). Two times with one key tie (memory, then the simpler, decide)."""
    return float(f"{seconds:.9g}")


def ranks_after(bound: float, seconds: float) -> bool:
    """Whether every configuration whose step-time bound is ``bound`` ranks after a result taking ``seconds``:
    its :func:`time_key` exceeds that of ``seconds`` even with the bound lowered by its float slack
    (:data:`BOUND_SLACK`). Rounding is monotone, so no such configuration can tie with it."""
    return time_key(bound * (1 - BOUND_SLACK)) > time_key(seconds)


@dataclass(frozen=True)
class Config:
    """A configuration before its recompute choice; ``key`` orders ties deterministically."""

    schedule: str
    pp: int
    dp: int
    num_microbatches: int
    virtual_stages: int
    split_backward: bool
    balance: tuple[int, ...]
    stage_to_rank: tuple[int, ...]
    time_bound: float  # seconds, <= any simulated step time of it
    static: tuple[float, ...]  # bytes per rank: parameters, gradients, optimizer state
    memory_bound: float  # bytes, <= the peak of its fullest rank whatever it recomputes

    @property
    def key(self) -> tuple:
        return (self.schedule, self.pp, self.num_microbatches, self.virtual_stages, self.split_backward, self.balance)


@dataclass(frozen=True)
class Evaluated:
    """A simulated configuration: its recompute choice, step time (s), bubble fraction, peak bytes per rank and
    its timeline (a :class:`~pipesched.Timeline`)."""

    config: Config
    recompute: tuple[bool, ...]
    step_time: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]
    timeline: object

    @property
    def rank_key(self) -> tuple:
        """Faster first (:func:`time_key`: to 9 significant digits, as sums in another order differ in the last
        bits), then less memory, then the simpler: fewer stages, no split backward, fewer recomputed stages; then
        by name."""
        c = self.config
        return (time_key(self.step_time), max(self.peak_memory), len(c.balance), c.split_backward,
                sum(self.recompute), c.key, self.recompute)


class Search:
    """One planning problem: the profile, sizes and options of :func:`pipesched.plan`, and caches of the shapes,
    balances and compiled programs it needs (built once per search, never shared: no module state)."""

    def __init__(self, profile, world_size, global_batch, schedules, optimizer_states, max_microbatches,
                 virtual_stages, split_backward, balance_fn) -> None:
        self.profile, self.world_size, self.global_batch = profile, world_size, global_batch
        self.schedules, self.optimizer_states = tuple(schedules), float(optimizer_states)
        self.max_microbatches, self.virtual_stages = max_microbatches, tuple(virtual_stages)
        self.split_choices = (False, True) if split_backward is None else (bool(split_backward),)
        self.balance_fn = balance_fn
        self.affine = any(any(getattr(profile, f"{name}_fixed")) for name in ("forward", "input_grad", "weight_grad"))
        self.shape = lru_cache(maxsize=None)(self._shape)
        self.balance = lru_cache(maxsize=None)(self._balance)
        self._costs = lru_cache(maxsize=None)(self._scaled)
        self._stage_costs = lru_cache(maxsize=None)(self._stage_costs_of)
        self.compute_only = lru_cache(maxsize=8)(self._compute_only)
        self.simulated = 0  # configurations simulated
        self.considered = 0  # configurations bounded

    # ---- enumeration -------------------------------------------------------------------------------------
    def configs(self):
        """Every configuration (memory aside), each with its bounds; in no particular order. Balances per
        placement: :func:`~pipesched.partition.balance_by_time`'s and the even one (``Pipeline``'s default), so a
        plan is never predicted slower than the default cut of a configuration it searched; with several stages
        per rank also its cut with ties broken towards even stages (``ties="even"``) and the cut of least slowest
        *stage* (the least per-rank load can come with a 1-layer stage next to a 20-layer one on the same rank,
        which lengthens the fill and drain; or not: the simulation decides between them).

        Left out as dominated by construction: on one pipeline rank (pp = 1), v > 1 stages per rank (interleaved,
        V placements) when a searched schedule runs v = 1 there -- the same layers and microbatches on the same
        rank in more calls, with no other rank to overlap (so no bubble to shrink), only per-call overhead --
        and split backward (no bubble to fill with W). v > 1 on pp = 1 stays when nothing searched runs v = 1
        (``schedules=["interleaved-1f1b"]`` on one rank)."""
        L = self.profile.num_layers
        single = any(1 in self._virtual_choices(name) for name in self.schedules)
        for pp in (d for d in range(1, min(self.world_size, L) + 1) if self.world_size % d == 0):
            dp = self.world_size // pp
            if self.global_batch % dp:
                continue
            for name in self.schedules:
                for v in self._virtual_choices(name):
                    shape = self.shape(name, pp, v)
                    if shape is None or pp * v > L or (pp == 1 and v > 1 and single):
                        continue  # pp = 1, v > 1: dominated (see above)
                    stage_to_rank, has_b, has_iw = shape
                    for m in self._microbatch_choices(dp, pp):
                        size = self.global_batch // (dp * m) if self.affine else None
                        for balance in self._balances(pp * v, stage_to_rank, size):
                            for split in self.split_choices if has_b and pp > 1 else (False,):
                                yield self.make_config(name, pp, dp, m, v, split or has_iw, balance, stage_to_rank,
                                                   split)

    def _balances(self, num_stages, stage_to_rank, size):
        """The cuts to simulate for a placement (see :meth:`configs`), without repeats."""
        several = len(set(stage_to_rank)) < num_stages
        extra = (self.balance(num_stages, stage_to_rank, size, "even"), self.balance(num_stages, None, size))
        return dict.fromkeys((self.balance(num_stages, stage_to_rank, size), *(extra if several else ()),
                              even(self.profile.num_layers, num_stages)))

    def make_config(self, name, pp, dp, m, v, split_flag, balance, stage_to_rank, split) -> Config:
        """The :class:`Config` with its bounds (``split_flag``: the program has I/W, for the time bound)."""
        c = self._stage_costs(balance, stage_to_rank, dp, self.global_batch // (dp * m))
        static = static_bytes(c, stage_to_rank, pp, self.optimizer_states)
        memory = max(s + a for s, a in zip(static, activation_bound(c, stage_to_rank, pp)))
        self.considered += 1
        return Config(name, pp, dp, m, v, split, balance, stage_to_rank,
                      step_time_bound(c, stage_to_rank, m, split_flag), static, memory)

    def _virtual_choices(self, name: str) -> tuple[int, ...]:
        info = get_schedule(name)
        if info.fixed_virtual_stages:
            return (info.default_virtual_stages,)
        if info.default_virtual_stages > 1:  # interleaved: v = 1 is another schedule's program
            return tuple(v for v in self.virtual_stages if v > 1) or (info.default_virtual_stages,)
        return (1,)

    def _microbatch_choices(self, dp: int, pp: int):
        per_replica = self.global_batch // dp
        cap = self.max_microbatches if self.max_microbatches is not None else min(256, max(8, 4 * pp))
        return [m for m in range(1, min(cap, per_replica) + 1) if per_replica % m == 0]

    def _shape(self, name, pp, v):
        """``(stage_to_rank, has B, has I/W)`` of the schedule at these sizes, or None if it cannot run them."""
        try:
            program = build(name, pp, 1, v)
        except ScheduleArgumentError:
            return None
        ops = {i.op for stream in program.ranks for i in stream}
        return program.stage_to_rank, Op.B in ops, Op.I in ops

    def _balance(self, num_stages, stage_to_rank, microbatch_size, ties="first"):
        """The time balance for microbatches of ``microbatch_size`` samples (``None``: the profile's own; the same
        cut whatever the size when every layer's time is proportional to it, i.e. no fixed parts)."""
        profile = self.profile if microbatch_size is None else self.profile.scaled(microbatch_size)
        return tuple(self.balance_fn(profile.layer_seconds(), num_stages, stage_to_rank=stage_to_rank, ties=ties))

    def scaled_costs(self, balance, dp, m):
        """The :class:`~pipesched.CostModel` of one microbatch of ``global_batch / (dp * m)`` samples."""
        return self._costs(balance, self.global_batch // (dp * m))

    def _scaled(self, balance, microbatch_size):
        return self.profile.scaled(microbatch_size).costs(balance)

    def stage_costs(self, config: Config) -> StageCosts:
        return self._stage_costs(config.balance, config.stage_to_rank, config.dp,
                                 self.global_batch // (config.dp * config.num_microbatches))

    def _stage_costs_of(self, balance, stage_to_rank, dp, microbatch_size):
        return stage_costs(self._costs(balance, microbatch_size), stage_to_rank, dp)

    def _compute_only(self, config: Config):
        """The compute-only program of ``config`` without recompute (split if asked): its compute order."""
        takes_costs = getattr(get_schedule(config.schedule), "takes_costs", False)
        costs = self.scaled_costs(config.balance, config.dp, config.num_microbatches) if takes_costs else None
        program = build(config.schedule, config.pp, config.num_microbatches, config.virtual_stages, costs=costs)
        return lower.split_backward(program, True) if config.split_backward else program

    def lowered(self, config: Config, recompute: tuple[bool, ...]):
        """The program :func:`~pipesched.compile_program` makes for ``config`` and ``recompute``, without its
        validation (the built-in passes are proven by the test suite; the returned candidates are validated)."""
        program = self.compute_only(config)
        if any(recompute):
            program = lower.add_recompute(program, list(recompute))
        return lower.add_all_reduce(lower.add_send_recv(program, check=False), config.dp)

    def compiled(self, config: Config, recompute: tuple[bool, ...]):
        """:func:`~pipesched.compile_program` of ``config`` and ``recompute``: validated."""
        takes_costs = getattr(get_schedule(config.schedule), "takes_costs", False)
        costs = self.scaled_costs(config.balance, config.dp, config.num_microbatches) if takes_costs else None
        return compile_program(config.schedule, config.pp, config.num_microbatches, config.virtual_stages,
                               dp_size=config.dp, recompute=list(recompute) if any(recompute) else False,
                               split_backward=config.split_backward, costs=costs)

    # ---- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, config: Config, budget: float, recompute=None) -> Evaluated | None:
        """Simulate ``config`` with the least recompute that fits ``budget`` bytes per rank (or the given per-stage
        ``recompute``); None when even recomputing every stage does not fit. Memory comes from the compute order
        (:func:`~pipesched.plan_bounds.activation_peak`, what the simulator would give), time from a simulation
        of the lowered program without byte sizes (so it skips its own memory pass)."""
        c = self.stage_costs(config)
        orders = compute_order(self.compute_only(config))
        if recompute is None:
            chosen = choose_recompute(orders, c, config.stage_to_rank, config.static, budget)
            if chosen is None:
                return None
            recompute, acts = chosen
        else:
            recompute = tuple(bool(x) for x in recompute)
            acts = tuple(activation_peak(order, c, recompute) for order in orders)
        cost = self.scaled_costs(config.balance, config.dp, config.num_microbatches)
        timed = replace(cost, stash_bytes=0.0, input_bytes=0.0, recompute_bytes=0.0)
        timeline = simulate(self.lowered(config, recompute), timed, check=False)
        self.simulated += 1
        peaks = tuple(s + a for s, a in zip(config.static, acts))
        return Evaluated(config, recompute, timeline.makespan, timeline.bubble_fraction, peaks, timeline)

    def confirm(self, result: Evaluated) -> Evaluated:
        """``result`` re-made from the validated program and a full simulation (time and memory): its timeline
        carries the simulator's peak activation bytes, and its peak memory is theirs."""
        config = result.config
        cost = self.scaled_costs(config.balance, config.dp, config.num_microbatches)
        timeline = simulate(self.compiled(config, result.recompute), cost, check=False)
        acts = timeline.peak_activation_bytes or (0.0,) * config.pp
        peaks = tuple(s + a for s, a in zip(config.static, acts))
        return Evaluated(config, result.recompute, timeline.makespan, timeline.bubble_fraction, peaks, timeline)

    def least_memory(self, config: Config) -> float:
        """The smallest peak bytes of ``config``'s fullest rank: every stage recomputed (each F then holds only
        its input)."""
        S = len(config.stage_to_rank)
        c = self.stage_costs(config)
        orders = compute_order(self.compute_only(config))
        flags = tuple(c.stash[s] > c.inputs[s] for s in range(S))
        return max(s + activation_peak(order, c, flags) for s, order in zip(config.static, orders))


def best_first(search: Search, configs, budget: float, top: int) -> list[Evaluated]:
    """The ``top`` fastest configurations that fit ``budget`` (ranked), simulating in order of the step-time bound
    and stopping once the next bound ranks after the ``top``-th best simulated step time (:func:`ranks_after`:
    a bound that ties with it to :func:`time_key` goes on, as a tie may hold less memory or be simpler)."""
    fitting = sorted((c for c in configs if c.memory_bound <= budget), key=lambda c: (c.time_bound, c.key))
    best: list = []  # (reversed rank key, result): a heap whose top is the worst kept result, at most `top`
    for config in fitting:
        if len(best) == top and ranks_after(config.time_bound, best[0][1].step_time):
            break
        result = search.evaluate(config, budget)
        if result is not None and max(result.peak_memory) <= budget:
            _keep(best, result, top)
    return sorted((item[1] for item in best), key=lambda e: e.rank_key)


def _keep(best: list, result: Evaluated, top: int) -> None:
    """Put ``result`` in the heap ``best`` if it ranks among the ``top`` best; of two with the same outcome
    (:func:`_same_outcome`: e.g. every schedule on pp=1) only the one ranked first, whichever came first."""
    item = (_Neg(result.rank_key), result)
    twin = next((kept for kept in best if _same_outcome(result, kept[1])), None)
    if twin is not None:
        if result.rank_key < twin[1].rank_key:  # the rank key's tie rule: the simpler one stays
            best[best.index(twin)] = item
            heapq.heapify(best)
    elif len(best) < top:
        heapq.heappush(best, item)
    elif result.rank_key < best[0][1].rank_key:
        heapq.heapreplace(best, item)


def _same_outcome(a: Evaluated, b: Evaluated) -> bool:
    """Two configurations that run the same: sizes, cut, recompute, predicted time (:func:`time_key`) and memory
    (schedules that coincide, as all do on one pipeline rank; split backward or not, when it changes nothing)."""
    ca, cb = a.config, b.config
    return (ca.pp, ca.dp, ca.num_microbatches, ca.balance, a.recompute, time_key(a.step_time), a.peak_memory) == \
        (cb.pp, cb.dp, cb.num_microbatches, cb.balance, b.recompute, time_key(b.step_time), b.peak_memory)


def smallest_fit(search: Search, configs) -> tuple[float, Config] | None:
    """The configuration whose fullest rank needs the fewest bytes (every stage recomputed) and those bytes,
    evaluating in order of the memory bound and stopping once the bound reaches the best found."""
    best = None
    for config in sorted(configs, key=lambda c: (c.memory_bound, c.time_bound, c.key)):
        if best is not None and config.memory_bound >= best[0]:
            break
        need = search.least_memory(config)
        if best is None or need < best[0]:
            best = (need, config)
    return best


def even(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage by count, larger stages first (``Pipeline(balance=None)``)."""
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


class _Neg:
    """Reverses the order of a key inside a min-heap (so the heap's top is the worst kept result)."""

    __slots__ = ("key",)

    def __init__(self, key) -> None:
        self.key = key

    def __lt__(self, other: "_Neg") -> bool:
        return other.key < self.key

    def __eq__(self, other) -> bool:
        return isinstance(other, _Neg) and self.key == other.key
