"""What the planner (:mod:`pipesched.planner`) returns: :class:`Candidate` (one planned configuration, what
``Pipeline.from_plan`` builds; its JSON form and the check of each field, so that a hand-edited or foreign JSON form is
refused naming the field), :class:`Plan` (the candidates that fit, best first, and what they were planned for) and
:class:`PlanError` (nothing fits the memory budget: the smallest that does). Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .checks import as_int, is_real
from .cost import CostError, CostModel
from .strict_json import unknown_keys_message

#: the keys of :meth:`Candidate.to_json`'s form (``layer_names`` and ``costs`` may be left out); any other is refused
_JSON_KEYS = ("schedule", "pp", "dp", "num_microbatches", "virtual_stages", "balance", "recompute", "split_backward",
              "microbatch_size", "step_time", "bubble_fraction", "peak_memory", "layer_names", "costs")


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
        bubble_fraction: predicted idle rank-seconds / (pp x step time), in [0, 1].
        peak_memory: predicted peak bytes per pipeline rank (every replica alike): parameters, gradients,
            optimizer state and the peak activation bytes.
        microbatch_size: samples per microbatch (global batch / (dp x m)).
        timeline: the simulated :class:`~pipesched.Timeline` (not compared, not in the JSON form).
        layer_names: the profiled model's layer class names (``()``: unknown; not compared), so that
            ``Pipeline.from_plan`` refuses a model of other layer classes given a Candidate as given a Plan.
        costs: the :class:`~pipesched.CostModel` (one microbatch, this balance) the plan simulated it with (``None``:
            unknown, e.g. read from JSON written without it; not compared; in the JSON form as
            :meth:`CostModel.to_json_dict` writes it). ``Pipeline.from_plan`` of a schedule built from costs
            (``zb-auto``) passes it, so the pipeline runs the very program the plan simulated.

    ``schedule`` is not looked up: a plan may name a schedule registered in the process that planned it.

    Raises:
        ValueError: a field of the wrong type, size or range (``bubble_fraction`` outside [0, 1], a time or a byte
            count negative or not finite, ...): names it, its value and what is valid.
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
    costs: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_candidate(self)
        for name in ("pp", "dp", "num_microbatches", "virtual_stages", "microbatch_size"):  # numpy ints: plain
            object.__setattr__(self, name, as_int(getattr(self, name)))
        object.__setattr__(self, "balance", type(self.balance)(as_int(b) for b in self.balance))

    def to_json(self) -> dict:
        """The JSON form (``pipesched plan --json``): ``schedule, pp, dp, num_microbatches, virtual_stages,
        balance, recompute, split_backward, microbatch_size, step_time, bubble_fraction, peak_memory`` (bytes per
        pipeline rank), ``layer_names`` when the profile has them and ``costs`` when known (a
        :meth:`CostModel.to_json_dict` object); :meth:`from_json` reads it back."""
        data = {"schedule": self.schedule, "pp": self.pp, "dp": self.dp, "num_microbatches": self.num_microbatches,
                "virtual_stages": self.virtual_stages, "balance": list(self.balance),
                "recompute": list(self.recompute), "split_backward": self.split_backward,
                "microbatch_size": self.microbatch_size, "step_time": self.step_time,
                "bubble_fraction": self.bubble_fraction, "peak_memory": [int(math.ceil(b)) for b in self.peak_memory]}
        if self.layer_names:
            data["layer_names"] = list(self.layer_names)
        if self.costs is not None:
            data["costs"] = self.costs.to_json_dict()
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Candidate":
        """A candidate from its :meth:`to_json` form (e.g. one entry of ``pipesched plan --json``'s
        ``"candidates"``), for :meth:`pipesched.runtime.Pipeline.from_plan` in a training script (no timeline).

        ``layer_names`` may be absent (JSON of an older pipesched: the model is then checked by layer count only),
        and ``costs`` absent or ``null`` (unknown: a ``zb-auto`` candidate's runtime then measures them); given, it is
        read as :meth:`CostModel.from_json_dict` reads it, each per-stage list one value per stage (pp x
        virtual_stages).

        Raises:
            ValueError: ``data`` is not a dict; a key is unknown (a typo such as ``split_backwards`` would otherwise
                be dropped, and the plan run without what it names: refused first, naming the closest known key)
                or missing; a value has the wrong type, size or range (names the key, its value and what is valid).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a planned candidate is a JSON object (dict), got {type(data).__name__}")
        unknown = unknown_keys_message(data, _JSON_KEYS, "a candidate's")
        if unknown:
            raise ValueError(f"planned candidate JSON: {unknown}")
        names = _JSON_KEYS[:-2]  # all but layer_names and costs
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"a planned candidate needs the keys {list(names)}; missing {missing}")
        values = {n: data[n] for n in names + ("layer_names",) if n in data}
        for n in ("balance", "recompute", "peak_memory", "layer_names"):
            if n in values:
                if not isinstance(values[n], (list, tuple)):
                    raise ValueError(f"candidate field {n!r} must be a list, got {values[n]!r}")
                values[n] = tuple(values[n])
        costs = data.get("costs")
        if costs is None:
            return cls(**values)
        where = "planned candidate JSON: costs: "
        candidate = cls(**values, costs=CostModel._from_json(costs, where))
        try:  # sizes and defaults as a use would check them (a list of another length than the stages)
            candidate.costs.check_stages(candidate.pp * candidate.virtual_stages)
        except CostError as exc:
            raise CostError(exc.field, f"{where}{exc} (pp x virtual_stages = "
                                       f"{candidate.pp} x {candidate.virtual_stages})") from None
        return candidate

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
        candidates: :class:`Candidate` s, ranked by step time (to 9 significant digits; ties: lower peak memory,
            then the simpler: fewer stages, no split backward, fewer recomputed stages; then name and sizes). Two
            configurations that run the same (one pipeline rank: every schedule) are one row, the simpler.
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
        """The winner: the first candidate, the fastest predicted step (``candidates[0]``)."""
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
    if c.bubble_fraction > 1:
        bad("bubble_fraction", "a fraction in [0, 1] (idle rank-seconds / (pp x step time))")
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
