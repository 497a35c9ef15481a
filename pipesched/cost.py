"""CostModel: how long each instruction takes and how big each message is (seconds and bytes)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Number = float | int
PerStage = Number | Sequence[Number]


@dataclass(frozen=True)
class CostModel:
    """Costs for :func:`pipesched.sim.simulate`. A per-stage field is one number for every stage or a
    sequence with one number per stage.

    Attributes:
        forward: seconds of one F (one stage, one microbatch). Default 1.
        backward: seconds of one full B. Default 2 (the usual 2x forward).
        input_grad: seconds of one I; default ``backward / 2``.
        weight_grad: seconds of one W; default ``backward / 2``.
        recompute: seconds of one R; default ``forward``.
        latency: seconds added to every message (SEND to RECV) and every all-reduce. Default 0.
        bandwidth: bytes per second of a link; default infinite (free transfers).
        activation_bytes: bytes of one microbatch's output of a stage (the message size; the gradient
            message has the same size). Default 0.
        grad_bytes: bytes of a stage's gradients, for ALL_REDUCE (ring: 2(d-1)/d of it crosses each link).
        stash_bytes: bytes a stage holds for backward per in-flight microbatch without recompute.
            Default: ``activation_bytes``.
        input_bytes: bytes of a stage's input per microbatch, kept instead of the stash when the stage
            recomputes. Default: the previous stage's ``activation_bytes`` (stage 0: ``activation_bytes``).
        recompute_bytes: bytes a recomputing stage holds for one microbatch after its ``R``: its input
            together with what the re-run forward saves, a tensor saved twice counted once. Default:
            ``max(stash_bytes, input_bytes)`` (the common case of a stage whose first layer saves its input).
            ``pipesched.runtime.stage_activation_bytes`` measures all three for a real model.

    Raises:
        ValueError: a cost is negative, not a number, or a sequence of the wrong length (at use).
    """

    forward: PerStage = 1.0
    backward: PerStage = 2.0
    input_grad: PerStage | None = None
    weight_grad: PerStage | None = None
    recompute: PerStage | None = None
    latency: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: PerStage = 0.0
    grad_bytes: PerStage = 0.0
    stash_bytes: PerStage | None = None
    input_bytes: PerStage | None = None
    recompute_bytes: PerStage | None = None

    def per_stage(self, name: str, num_stages: int) -> tuple[float, ...]:
        """The named field as one float per stage (defaults resolved)."""
        value = getattr(self, name)
        if value is None:
            return self._default(name, num_stages)
        values = [value] * num_stages if isinstance(value, (int, float)) else list(value)
        if len(values) != num_stages:
            raise ValueError(f"cost {name} has {len(values)} values but the program has {num_stages} stages")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
                raise ValueError(f"cost {name} must be a number >= 0 (seconds or bytes), got {v!r}")
        return tuple(float(v) for v in values)

    def _default(self, name: str, num_stages: int) -> tuple[float, ...]:
        if name in ("input_grad", "weight_grad"):
            return tuple(b / 2 for b in self.per_stage("backward", num_stages))
        if name == "recompute":
            return self.per_stage("forward", num_stages)
        if name == "stash_bytes":
            return self.per_stage("activation_bytes", num_stages)
        if name == "recompute_bytes":
            pairs = zip(self.per_stage("stash_bytes", num_stages), self.per_stage("input_bytes", num_stages))
            return tuple(max(stash, inp) for stash, inp in pairs)
        if name == "input_bytes":
            act = self.per_stage("activation_bytes", num_stages)
            return (act[0],) + act[:-1]
        raise ValueError(f"cost {name} has no default")

    def message_seconds(self, nbytes: float) -> float:
        """Latency plus transfer time of one message of ``nbytes`` bytes."""
        if self.latency < 0 or self.bandwidth <= 0:
            raise ValueError(f"latency must be >= 0 and bandwidth > 0, got {self.latency}, {self.bandwidth}")
        return self.latency + (0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth)

    def describe(self) -> str:
        """A one-line summary for plot titles: the assumptions a timeline depends on."""
        parts = [f"F={_fmt(self.forward)}", f"B={_fmt(self.backward)}"]
        for name, label in (("input_grad", "I"), ("weight_grad", "W"), ("recompute", "R")):
            if getattr(self, name) is not None:
                parts.append(f"{label}={_fmt(getattr(self, name))}")
        if self.latency:
            parts.append(f"latency={self.latency:g}s")
        if not math.isinf(self.bandwidth):
            parts.append(f"bw={self.bandwidth:.3g}B/s")
        return " ".join(parts)


def _fmt(value) -> str:
    if isinstance(value, (int, float)):
        return f"{value:g}"
    return "[" + ",".join(f"{v:g}" for v in value) + "]"
