"""CostModel: how long each instruction takes and how big each message is (seconds and bytes)."""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from .checks import is_real, plain_number
from .strict_json import check_json_object

Number = float | int
PerStage = Number | Sequence[Number]


class CostError(ValueError):
    """A bad cost. ``field`` names the :class:`CostModel` field at fault (``"input_grad"``, ``"bandwidth"``, ...),
    so a front end can name its own option for it; the message says what is wrong and what is valid."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (type(self), (self.field, self.args[0]))


@dataclass(frozen=True)
class CostModel:
    """Costs for :func:`pipesched.sim.simulate`. A per-stage field is one number for every stage or a
    sequence with one number per stage.

    Attributes:
        forward: seconds of one F (one stage, one microbatch). Default 1.
        backward: seconds of one full B. Default 2 (the usual 2x forward).
        input_grad: seconds of one I; default ``backward - weight_grad`` when ``weight_grad`` is given, else
            ``backward / 2``: the split backward does B's work once, in two halves.
        weight_grad: seconds of one W; default ``backward - input_grad`` when ``input_grad`` is given, else
            ``backward / 2``.
        recompute: seconds of one R; default ``forward``.
        latency: seconds added to every message (SEND to RECV) and every all-reduce. Default 0.
        send_overhead: seconds of the sending rank's own time that each SEND takes (LogP's overhead ``o``: on gloo,
            the copy and hand-off inside the send call, during which the rank computes nothing). The message's
            ``latency + bytes / bandwidth`` counts from the SEND's end. A compute-only program (no SEND
            instructions) adds it to the delay of each message instead. Default 0 (a SEND is free to its rank).
        bandwidth: bytes per second of a link; default infinite (free transfers).
        activation_bytes: bytes of one microbatch's output of a stage (the message size; the gradient
            message has the same size). Default 0.
        grad_bytes: bytes of a stage's gradients, for ALL_REDUCE (ring: 2(d-1)/d of it crosses each link).
        tie_bytes: bytes of the tied parameters' gradients that the ``TIE_REDUCE`` naming a stage sums (ring over
            the tie's k ranks: 2(k-1)/k of it crosses each link).
        stash_bytes: bytes a stage holds for backward per in-flight microbatch without recompute.
            Default: ``activation_bytes``.
        input_bytes: bytes of a stage's input per microbatch, kept instead of the stash when the stage
            recomputes. Default: the previous stage's ``activation_bytes`` (stage 0: its own), but at most
            ``stash_bytes``: as for ``recompute_bytes``, the stage's first layer is taken to save its input, so the
            input is part of the stash and recomputing never holds more than not recomputing. Give it when the
            stash does not hold the input (measured: ``stage_activation_bytes``).
        recompute_bytes: bytes a recomputing stage holds for one microbatch after its ``R``: its input
            together with what the re-run forward saves, a tensor saved twice counted once. Default:
            ``max(stash_bytes, input_bytes)`` (the common case of a stage whose first layer saves its input).
            ``pipesched.runtime.stage_activation_bytes`` measures all three for a real model.

    Raises:
        CostError: (a ``ValueError`` whose ``field`` names the field) at construction, a cost that is negative,
            infinite, NaN or not a number (a string is not a sequence of costs), a bandwidth <= 0, or a
            ``recompute_bytes`` below ``input_bytes`` on some stage (both given); at use, a per-stage sequence of the
            wrong length, or one of ``input_grad``/``weight_grad`` given above ``backward`` with the other left to
            its default (``backward`` minus it).
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
    tie_bytes: PerStage = 0.0
    send_overhead: float = 0.0

    def __post_init__(self) -> None:
        self._unwrap_0d_arrays()
        for name in _PER_STAGE + _SCALAR_SECONDS:
            if getattr(self, name) is None and name not in _OPTIONAL:
                raise CostError(name, f"cost {name} must be a finite number >= 0 ({_unit(name)}), got None (only "
                                      f"{', '.join(_OPTIONAL)} may be None: they have defaults)")
        for name in _PER_STAGE:
            value = getattr(self, name)
            if value is None or is_real(value):
                _check_finite(name, value)
                continue
            if isinstance(value, (str, bytes, Mapping, Set)) or not hasattr(value, "__len__"):
                raise CostError(name, f"cost {name} must be a number or a sequence of numbers (one per stage, in "
                                      f"stage order: a list, tuple or 1-d array), got {value!r}")
            for item in value:
                _check_finite(name, item)
        for name in _SCALAR_SECONDS:
            _check_finite(name, getattr(self, name))
        if not (is_real(self.bandwidth) and self.bandwidth > 0):
            raise CostError("bandwidth", f"cost bandwidth must be a number of bytes/s > 0 (inf: free transfers), "
                                         f"got {self.bandwidth!r}")
        self._check_recompute_holds_input()
        self._hold_plain_numbers()

    def _unwrap_0d_arrays(self) -> None:
        """A 0-d array given for a field (``np.array(0.5)``, a 0-d tensor) is held as the one number it holds."""
        for name in _PER_STAGE + _SCALAR_SECONDS + ("bandwidth",):
            value = getattr(self, name)
            if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
                object.__setattr__(self, name, value.item())

    def _hold_plain_numbers(self) -> None:
        """A numpy number given (``np.int64(4)``, an array of them) is held as a plain int or float, and every
        per-stage sequence as a tuple of them (a copy: a list changed after construction does not change the checked
        costs, and the model stays hashable), so that no numpy number reaches a timeline, JSON or torch."""
        for name in _PER_STAGE + ("latency", "bandwidth", "send_overhead"):
            value = getattr(self, name)
            if is_real(value):
                if type(value) not in (int, float):
                    object.__setattr__(self, name, plain_number(value))
            elif value is not None:
                object.__setattr__(self, name, tuple(plain_number(v) for v in value))

    def _check_recompute_holds_input(self) -> None:
        """``recompute_bytes`` includes the stage input, so it cannot be below ``input_bytes`` (both given)."""
        if self.input_bytes is None or self.recompute_bytes is None:
            return
        held, kept = self.recompute_bytes, self.input_bytes
        n = next((len(v) for v in (held, kept) if not is_real(v)), 1)
        pairs = zip([held] * n if is_real(held) else held, [kept] * n if is_real(kept) else kept)
        for stage, (h, k) in enumerate(pairs):
            if h < k:
                raise CostError("recompute_bytes", f"cost recompute_bytes ({h:g} for stage {stage}) must be >= "
                                                   f"input_bytes ({k:g}): what a stage holds after its R includes "
                                                   f"its input")

    def per_stage(self, name: str, num_stages: int) -> tuple[float, ...]:
        """The named field as one float per stage (defaults resolved).

        Raises:
            ValueError: ``name`` is not a per-stage field (names the valid ones).
            CostError: a sequence whose length is not ``num_stages``.
        """
        if name not in _PER_STAGE:
            raise ValueError(f"per_stage: name {name!r} is not a per-stage cost; valid: {', '.join(_PER_STAGE)}")
        value = getattr(self, name)
        if value is None:
            return self._default(name, num_stages)
        values = [value] * num_stages if is_real(value) else list(value)
        if len(values) != num_stages:
            raise CostError(name, f"cost {name} has {len(values)} values but the program has {num_stages} stages")
        return tuple(float(v) for v in values)

    def check_stages(self, num_stages: int) -> None:
        """Check that every per-stage cost resolves for ``num_stages`` stages (a list of that length, or a number).

        Raises:
            CostError: the first per-stage cost whose list has another length (names it and both counts).
        """
        for name in _PER_STAGE:
            self.per_stage(name, num_stages)

    def _default(self, name: str, num_stages: int) -> tuple[float, ...]:
        if name in ("input_grad", "weight_grad"):  # the other half of B when one is given, else half of B
            other = "weight_grad" if name == "input_grad" else "input_grad"
            backward = self.per_stage("backward", num_stages)
            if getattr(self, other) is None:
                return tuple(b / 2 for b in backward)
            given = self.per_stage(other, num_stages)
            for stage, (b, o) in enumerate(zip(backward, given)):
                if o - b > 1e-9 * b:  # beyond float rounding (0.1 + 0.2 for 0.3 is 0.3: I or W of 0)
                    raise CostError(other, f"cost {name} defaults to backward - {other}, but {other} ({o!r} for "
                                          f"stage {stage}) exceeds backward ({b!r}): give {name} too, or a "
                                          f"backward >= {other}")
            return tuple(max(0.0, b - o) for b, o in zip(backward, given))
        if name == "recompute":
            return self.per_stage("forward", num_stages)
        if name == "stash_bytes":
            return self.per_stage("activation_bytes", num_stages)
        if name == "recompute_bytes":
            pairs = zip(self.per_stage("stash_bytes", num_stages), self.per_stage("input_bytes", num_stages))
            return tuple(max(stash, inp) for stash, inp in pairs)
        if name == "input_bytes":  # the previous stage's output, within this stage's stash (see the docstring)
            act = self.per_stage("activation_bytes", num_stages)
            stash = self.per_stage("stash_bytes", num_stages)
            return tuple(min(a, s) for a, s in zip((act[0],) + act[:-1], stash))
        raise ValueError(f"cost {name} has no default")

    def message_seconds(self, nbytes: float) -> float:
        """Latency plus transfer time of one message of ``nbytes`` bytes (seconds).

        Raises:
            ValueError: ``nbytes`` is negative or not a finite number.
        """
        if not (is_real(nbytes) and math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"message_seconds: nbytes must be a finite number of bytes >= 0, got {nbytes!r}")
        return self.latency + (0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth)

    def overflow_error(self, num_stages: int, count: int, seconds: bool = True) -> CostError:
        """The :class:`CostError` for a simulation whose times (``seconds``) or held bytes (``not seconds``) summed
        past the largest float: every cost itself finite, ``count`` of them (instructions, or microbatches held)
        add up to infinity. Names the fields large enough to do that (each value at least ``float max / count``;
        else the largest), the largest as ``field``."""
        big = sys.float_info.max
        given = [n for n in (_SECONDS + _SCALAR_SECONDS if seconds else _HELD) if getattr(self, n) is not None]
        if seconds and not math.isinf(self.bandwidth):  # a message's seconds: its bytes / bandwidth
            given += ["activation_bytes", "grad_bytes", "tie_bytes"]
        if not seconds and self.stash_bytes is None:  # the default stash (and input) is the activation bytes
            given.append("activation_bytes")
        largest = {n: max(self.per_stage(n, num_stages), default=0.0) if n not in _SCALAR_SECONDS
                   else float(getattr(self, n)) for n in given}
        values = {n: v / self.bandwidth if seconds and n.endswith("_bytes") else v for n, v in largest.items()}
        ranked = sorted(values, key=values.__getitem__, reverse=True)
        culprits = [n for n in ranked if values[n] * max(count, 1) >= big] or ranked[:1]

        def shown(name: str) -> str:
            if seconds and name.endswith("_bytes"):
                return f"{name} = {largest[name]:.3g} B at bandwidth = {self.bandwidth:.3g} B/s"
            return f"{name} = {values[name]:.3g}" + (" s" if seconds else " B")

        what = "the step's seconds" if seconds else "the activation bytes a rank holds"
        unit = "instructions" if seconds else "microbatches"
        return CostError(culprits[0], f"cost {', '.join(culprits)} too large: {what} add up past the largest float "
                                      f"({big:.3g}) over {count} {unit} ({'; '.join(map(shown, culprits))}); give "
                                      f"the costs in larger units (the bubble fraction does not depend on the unit)")

    def to_json_dict(self) -> dict:
        """A JSON-ready dict that :meth:`from_json_dict` reads back: every field by name, a per-stage sequence as a
        list, an optional field left to its default as ``null``, and an infinite ``bandwidth`` (free transfers;
        JSON has no infinity) as the string ``"inf"``."""
        data = {}
        for name in _JSON_KEYS:
            value = getattr(self, name)
            data[name] = list(value) if isinstance(value, tuple) else value
        if math.isinf(self.bandwidth):
            data["bandwidth"] = "inf"
        return data

    @classmethod
    def from_json_dict(cls, data: dict) -> "CostModel":
        """A cost model from its :meth:`to_json_dict` form, read strictly: each key a field of :class:`CostModel`
        (one left out takes its default, as in ``CostModel(...)``), a per-stage field a JSON number or a list of
        them (one per stage), an optional field ``null`` for its default, ``bandwidth`` a number > 0 or ``"inf"``.

        Raises:
            ValueError: ``data`` is not a dict; a key is unknown (named, with the closest known key); a value the
                constructor refuses (a :class:`CostError` naming the field, its value and what is valid). The
                message starts ``CostModel JSON:``.
        """
        return cls._from_json(data, "CostModel JSON: ")

    @classmethod
    def _from_json(cls, data, where: str) -> "CostModel":
        """:meth:`from_json_dict`, its messages starting with ``where``."""
        check_json_object(data, _JSON_KEYS, "a CostModel's", where,
                          "a cost model is a JSON object (as CostModel.to_json_dict writes)")
        values = dict(data)
        bandwidth = values.get("bandwidth", math.inf)
        if bandwidth == "inf":
            values["bandwidth"] = math.inf
        elif not (is_real(bandwidth) and bandwidth > 0):
            raise CostError("bandwidth", f"{where}cost bandwidth must be a number of bytes/s > 0 or \"inf\" (free "
                                         f"transfers), got {bandwidth!r}")
        try:
            return cls(**values)
        except CostError as exc:
            raise CostError(exc.field, where + str(exc)) from None

    def describe(self) -> str:
        """A one-line summary for plot titles: the assumptions a timeline depends on (seconds; bytes given, as
        ``act=...B``)."""
        parts = [f"F={_fmt(self.forward)}", f"B={_fmt(self.backward)}"]
        for name, label in (("input_grad", "I"), ("weight_grad", "W"), ("recompute", "R")):
            if getattr(self, name) is not None:
                parts.append(f"{label}={_fmt(getattr(self, name))}")
        for name, label in (("activation_bytes", "act"), ("grad_bytes", "grads"), ("stash_bytes", "stash"),
                            ("input_bytes", "input"), ("recompute_bytes", "held after R"), ("tie_bytes", "ties")):
            value = getattr(self, name)
            if value is not None and value != 0:
                parts.append(f"{label}={_fmt(value)}B")
        if self.latency:
            parts.append(f"latency={self.latency:g}s")
        if self.send_overhead:
            parts.append(f"send={self.send_overhead:g}s")
        if not math.isinf(self.bandwidth):
            parts.append(f"bw={self.bandwidth:.3g}B/s")
        return " ".join(parts)


_SECONDS = ("forward", "backward", "input_grad", "weight_grad", "recompute")
_SCALAR_SECONDS = ("latency", "send_overhead")  # one number for every message, not per stage
_OPTIONAL = ("input_grad", "weight_grad", "recompute", "stash_bytes", "input_bytes", "recompute_bytes")  # None: default
_HELD = ("stash_bytes", "input_bytes", "recompute_bytes")
_PER_STAGE = ("forward", "backward", "input_grad", "weight_grad", "recompute", "activation_bytes", "grad_bytes",
              "stash_bytes", "input_bytes", "recompute_bytes", "tie_bytes")
#: the keys of :meth:`CostModel.to_json_dict`'s form: every field, in declaration order
_JSON_KEYS = ("forward", "backward", "input_grad", "weight_grad", "recompute", "latency", "bandwidth",
              "activation_bytes", "grad_bytes", "stash_bytes", "input_bytes", "recompute_bytes", "tie_bytes",
              "send_overhead")


def _check_finite(name: str, value) -> None:
    if value is None:
        return
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise CostError(name, f"cost {name} must be a finite number >= 0 ({_unit(name)}), got {value!r}")


def _unit(name: str) -> str:
    """The unit of cost field ``name``: ``bytes`` for the sizes (``*_bytes``), else ``seconds`` (times, latency,
    send_overhead; bandwidth, bytes/s, has its own message)."""
    return "bytes" if name.endswith("_bytes") else "seconds"


def _fmt(value) -> str:
    """``value`` (a number or a per-stage list) for :meth:`CostModel.describe`: ``:g``, but a whole number below
    2**53 in full (a byte count of 1048576 stays ``1048576``, not ``1.04858e+06``)."""
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else f"{value:g}"
    return "[" + ",".join(_fmt(v) for v in value) + "]"
