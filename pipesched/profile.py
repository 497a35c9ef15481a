"""LayerProfile: what one microbatch costs in each layer of an ``nn.Sequential`` (seconds and bytes), as plain data.

Made by :func:`pipesched.runtime.profile_layers` (which runs the model), read by the planner
(:func:`pipesched.plan`) and the time balance (``Pipeline(balance="time", profile=...)``); saved and loaded as JSON,
so a profile taken once on the target machine plans any number of runs. Torch-free.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from . import strict_json
from .checks import as_int
from .checks import check_path, is_real, plain_number
from .cost import CostModel

FORMAT = "pipesched.LayerProfile"
VERSION = 1
_PER_LAYER = ("forward", "input_grad", "weight_grad", "activation_bytes", "output_bytes", "param_bytes")
_TIMES = ("forward", "input_grad", "weight_grad")
_FIXED = tuple(f"{name}_fixed" for name in _TIMES)


@dataclass(frozen=True)
class LayerProfile:
    """Per layer of a model, the cost of one microbatch of ``microbatch_size`` samples.

    Attributes:
        forward: seconds of the layer's forward, per layer.
        input_grad: seconds of its input-gradient half of the backward (``I``), per layer.
        weight_grad: seconds of its weight-gradient half (``W``; 0 for a layer without parameters), per layer.
        activation_bytes: bytes the layer's forward saves for its backward, per layer (its input included when it
            saves it).
        output_bytes: bytes of the layer's output, per layer (what crosses a link when a stage ends there).
        param_bytes: bytes of the layer's parameters, per layer (its gradients are as many).
        microbatch_size: samples (rows of the first dimension) in the profiled microbatch, >= 1.
        input_bytes: bytes of the model's input for one microbatch.
        latency: seconds added to every message between two ranks (0: not measured).
        bandwidth: bytes per second of a link between two ranks (``inf``: not measured).
        send_overhead: seconds of the sending rank's own time per message (:class:`~pipesched.cost.CostModel`'s
            ``send_overhead``; 0: not measured, and profiles saved before this field).
        layer_names: the layers' class names, to tell a profile of another model.
        device: where it was measured (``"cpu"``, ``"cuda:0"``), for the reader.
        forward_fixed, input_grad_fixed, weight_grad_fixed: per layer, the seconds of ``forward``, ``input_grad``,
            ``weight_grad`` that do not grow with the microbatch (the intercept of time = fixed + slope x samples:
            every op's dispatch, kernel launches), as :func:`~pipesched.runtime.profile_layers` fits them from two
            microbatch sizes; ``()`` (the default, and profiles saved before these fields) reads as all 0
            (time proportional to the samples). :meth:`scaled` uses them.
        boundary_saves: the tensors that pass between layers (the model's input, a layer's output) and that some
            layer saves for backward, as ``(first, last, ((layer, bytes), ...))`` per tensor: it is the input of
            layers ``first`` .. ``last`` (a layer returning its input, or a view of it at the same address, passes
            it on), and each listed layer's ``activation_bytes`` holds ``bytes`` of it (layer ``first - 1``: it
            saves its output). In one stage such a tensor counts once (the most any of the stage's layers saves of
            it), as ``stage_activation_bytes`` counts it: a Tanh's output that the next Linear saves as its input
            is not stashed twice. :func:`~pipesched.runtime.profile_layers` records them; ``None`` (the default,
            and profiles saved before this field): unknown, so :meth:`costs` sums the layers' bytes and takes a
            stage's first layer to save its input.

    Raises:
        ValueError: at construction, per-layer fields of different lengths or empty, a value that is negative,
            NaN or infinite, a ``microbatch_size`` < 1 or a bandwidth <= 0, a fixed part outside
            ``[0, its time]``, a ``boundary_saves`` entry that is malformed, names a layer outside
            ``first - 1`` .. ``last`` or out of order, or more bytes than the layer's ``activation_bytes``; the
            message names the field.
    """

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    microbatch_size: int
    input_bytes: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    layer_names: tuple[str, ...] = ()
    device: str = "cpu"
    forward_fixed: tuple[float, ...] = ()
    input_grad_fixed: tuple[float, ...] = ()
    weight_grad_fixed: tuple[float, ...] = ()
    boundary_saves: tuple[tuple[int, int, tuple[tuple[int, float], ...]], ...] | None = None
    send_overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in _PER_LAYER:
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        n = len(self.forward)
        if n == 0:
            raise ValueError("LayerProfile.forward is empty: a profile needs at least one layer")
        for name in _PER_LAYER:
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"LayerProfile.{name} has {len(values)} values but forward has {n} (one per layer)")
            object.__setattr__(self, name, tuple(_check_value(f"{name}[{i}]", v) for i, v in enumerate(values)))
        if self.layer_names and len(self.layer_names) != n:
            raise ValueError(f"LayerProfile.layer_names has {len(self.layer_names)} names but there are {n} layers")
        size = as_int(self.microbatch_size)
        if size is None or size < 1:
            raise ValueError(f"LayerProfile.microbatch_size must be an int >= 1, got {self.microbatch_size!r}")
        object.__setattr__(self, "microbatch_size", size)  # a numpy integer becomes a plain int (JSON, programs)
        for name in ("input_bytes", "latency", "send_overhead"):  # numpy numbers held as plain ones
            object.__setattr__(self, name, _check_value(name, getattr(self, name)))
        if not (is_real(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"LayerProfile.bandwidth must be bytes/s > 0 (inf: free), got {self.bandwidth!r}")
        object.__setattr__(self, "bandwidth", plain_number(self.bandwidth))
        for name, fixed_name in zip(_TIMES, _FIXED):
            self._check_fixed(name, fixed_name)
        if self.boundary_saves is not None:
            object.__setattr__(self, "boundary_saves", _checked_saves(self.boundary_saves, self.activation_bytes))

    def _check_fixed(self, name: str, fixed_name: str) -> None:
        """Normalise ``<name>_fixed`` (``()``: zeros) and check 0 <= fixed <= time per layer."""
        times, fixed = getattr(self, name), tuple(getattr(self, fixed_name))
        fixed = fixed or (0.0,) * len(times)
        if len(fixed) != len(times):
            raise ValueError(f"LayerProfile.{fixed_name} has {len(fixed)} values but there are {len(times)} layers "
                             f"(one per layer, or none)")
        checked = []
        for i, (value, total) in enumerate(zip(fixed, times)):
            checked.append(_check_value(f"{fixed_name}[{i}]", value))
            if value > total:
                raise ValueError(f"LayerProfile.{fixed_name}[{i}] = {value!r} s exceeds {name}[{i}] = {total!r} s: "
                                 f"the fixed part of a time must be in [0, the time]")
        object.__setattr__(self, fixed_name, tuple(checked))

    @property
    def num_layers(self) -> int:
        """The profiled model's layer count: one per entry of ``forward`` (and of every per-layer field)."""
        return len(self.forward)

    def layer_seconds(self) -> tuple[float, ...]:
        """Per layer, forward + input gradient + weight gradient seconds: what a stage's load adds up."""
        return tuple(f + i + w for f, i, w in zip(self.forward, self.input_grad, self.weight_grad))

    def scaled(self, microbatch_size: int) -> LayerProfile:
        """This profile for microbatches of ``microbatch_size`` samples (``k``): per layer and time, the fixed part
        plus the rest in proportion, ``fixed + (t - fixed) x k / microbatch_size`` seconds (an affine model: a
        small microbatch still pays every op's dispatch; with the fixed parts 0, plain proportion); activation,
        output and input bytes in proportion (exact; ``boundary_saves``' bytes too); parameter bytes and the fixed
        parts unchanged (so scaling twice is scaling once).

        Raises:
            ValueError: ``microbatch_size`` < 1.
        """
        size = as_int(microbatch_size)
        if size is None or size < 1:
            raise ValueError(f"microbatch_size must be an int >= 1, got {microbatch_size!r}")
        microbatch_size = size
        if microbatch_size == self.microbatch_size:
            return self
        k = microbatch_size / self.microbatch_size
        scale = {name: tuple(v * k for v in getattr(self, name))
                 for name in ("activation_bytes", "output_bytes")}
        if self.boundary_saves is not None:
            scale["boundary_saves"] = tuple((first, last, tuple((layer, b * k) for layer, b in saves))
                                            for first, last, saves in self.boundary_saves)
        for name, fixed_name in zip(_TIMES, _FIXED):
            scale[name] = tuple(f + (t - f) * k for t, f in zip(getattr(self, name), getattr(self, fixed_name)))
        return replace(self, microbatch_size=microbatch_size, input_bytes=self.input_bytes * k, **scale)

    def costs(self, balance, recompute_seconds: bool = True) -> CostModel:
        """The :class:`~pipesched.CostModel` (seconds, bytes) of stages made of consecutive layers, ``balance[s]``
        layers in stage ``s``: per stage the sums of its layers' F, I, W (B = I + W; R = F when
        ``recompute_seconds``), the stash (sum of saved bytes, a tensor that several of its layers save counted
        once: :attr:`boundary_saves`), the message (its last layer's output), its input (the previous stage's
        message; stage 0: the model's input), what it holds after a recompute (its input and the stash, the
        saved bytes of the input counted once) and its gradients (its parameter bytes); the link's latency and
        bandwidth, and the send overhead. With :attr:`boundary_saves` these are the bytes ``stage_activation_bytes`` measures for the
        same cut; without (``None``), the layers' bytes are summed and a stage's first layer is taken to save its
        input (input bytes at most the stash; held after a recompute: the larger of the two).

        Raises:
            ValueError: ``balance`` is not a sequence of ints >= 1 summing to :attr:`num_layers`.
        """
        starts = _starts(balance, self.num_layers)
        spans = list(zip(starts, starts[1:]))

        def per_stage(name):
            values = getattr(self, name)
            return tuple(float(sum(values[a:b])) for a, b in spans)

        outputs = tuple(float(self.output_bytes[b - 1]) for _, b in spans)
        inputs = (float(self.input_bytes),) + outputs[:-1]
        stash = per_stage("activation_bytes")
        if self.boundary_saves is None:  # unknown: the first layer is taken to save the input
            held, inputs = None, tuple(min(i, s) if s else i for i, s in zip(inputs, stash))
        else:
            stash, held = self._stage_bytes(spans, stash, inputs)
        I, W = per_stage("input_grad"), per_stage("weight_grad")
        return CostModel(forward=per_stage("forward"), backward=tuple(i + w for i, w in zip(I, W)), input_grad=I,
                         weight_grad=W, recompute=per_stage("forward") if recompute_seconds else None,
                         activation_bytes=outputs, stash_bytes=stash, input_bytes=inputs, recompute_bytes=held,
                         grad_bytes=per_stage("param_bytes"), latency=self.latency, bandwidth=self.bandwidth,
                         send_overhead=self.send_overhead)

    def _stage_bytes(self, spans, sums, inputs):
        """Per stage ``[a, b)``, the stash (``sums``, each tensor of :attr:`boundary_saves` counted once: the most
        one of the stage's layers saves of it) and what a recompute holds (the input plus the stash less what the
        stage saves of its input, which the input already holds)."""
        stash, held = [], []
        for (a, b), total, nbytes in zip(spans, sums, inputs):
            of_input = 0.0
            for first, last, saves in self.boundary_saves:
                inside = [v for layer, v in saves if a <= layer < b]
                if inside:
                    total -= sum(inside) - max(inside)
                    if first <= a <= last:  # a tensor of the stage's input
                        of_input += max(inside)
            stash.append(max(total, 0.0))
            held.append(max(nbytes + total - of_input, nbytes))
        return tuple(stash), tuple(held)

    def check_model(self, num_layers: int, layer_names=None) -> None:
        """Refuse a profile of another model.

        Raises:
            TypeError: ``num_layers`` is not an ``int``.
            ValueError: the layer count differs, or (both known) the layers' class names differ; the message
                names the first differing layer.
        """
        if type(num_layers) is not int:  # a string "8" is not the model's 8 layers (the message said it was)
            raise TypeError(f"num_layers must be an int (the model's layer count), got {type(num_layers).__name__} "
                            f"{num_layers!r}")
        if num_layers != self.num_layers:
            raise ValueError(f"profile has {self.num_layers} layers but the model has {num_layers}: the profile is "
                             f"of another model (profile the model with pipesched.runtime.profile_layers)")
        if layer_names and self.layer_names and tuple(layer_names) != self.layer_names:
            i = next(i for i, (a, b) in enumerate(zip(layer_names, self.layer_names)) if a != b)
            raise ValueError(f"profile's layer {i} is a {self.layer_names[i]} but the model's is a {layer_names[i]}: "
                             f"the profile is of another model")

    def to_json(self) -> dict:
        """The JSON form (``format``, ``version`` and every field; seconds, bytes, an infinite bandwidth as ``null``):
        what :meth:`save` writes and :meth:`from_json` reads back."""
        data = asdict(self)
        data["bandwidth"] = None if math.isinf(self.bandwidth) else self.bandwidth
        return {"format": FORMAT, "version": VERSION, **data}

    @classmethod
    def from_json(cls, data: dict) -> LayerProfile:
        """Raises ValueError: not a pipesched LayerProfile (format/version), or a missing or unknown field."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a pipesched LayerProfile (expected format {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"LayerProfile version {data.get('version')!r} is not supported (this pipesched reads "
                             f"version {VERSION})")
        names = {f.name for f in fields(cls)}
        body = {k: v for k, v in data.items() if k not in ("format", "version")}
        unknown, missing = set(body) - names, {n for n in _PER_LAYER + ("microbatch_size",) if n not in body}
        if unknown or missing:
            raise ValueError(f"LayerProfile JSON: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
        if body.get("bandwidth", 0) is None:
            body["bandwidth"] = math.inf
        return cls(**body)  # boundary_saves: absent or null -> None (unknown)

    def save(self, path) -> None:
        """Write the profile as JSON to ``path``. Raises TypeError: ``path`` not a ``str`` or ``os.PathLike``."""
        check_path(path)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path) -> LayerProfile:
        """Read a profile written by :meth:`save`.

        Raises:
            FileNotFoundError: no file at ``path``. ValueError: not JSON, a JSON object giving a key twice, or not
                a valid profile (names the path). TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        """
        check_path(path)
        try:
            return cls.from_json(strict_json.load_file(path, "LayerProfile.save"))  # a key twice: refused
        except json.JSONDecodeError:
            raise  # names the file and its writer
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None


def _check_value(name: str, value):
    """``value`` as a plain int or float: any real number but a bool (numpy's too: ``np.float32``), finite, >= 0."""
    if not is_real(value) or not math.isfinite(value) or value < 0:
        unit = "bytes" if "bytes" in name else "seconds"  # the sizes' names say bytes; the rest are times
        raise ValueError(f"LayerProfile.{name} must be a finite number >= 0 ({unit}), got {value!r}")
    return plain_number(value)


def _checked_saves(saves, activation_bytes) -> tuple:
    """``boundary_saves`` as tuples (JSON gives lists), checked against the layers' ``activation_bytes``."""
    n, result = len(activation_bytes), []
    try:
        for k, (first, last, entries) in enumerate(saves):
            where = f"LayerProfile.boundary_saves[{k}]"
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in (first, last)) \
                    or not 0 <= first <= last < n:
                raise ValueError(f"{where}: first, last = {first!r}, {last!r} must be layers with 0 <= first <= last "
                                 f"< {n}")
            entries = tuple((layer, nbytes) for layer, nbytes in entries)
            layers = [layer for layer, _ in entries]
            if not entries or not all(isinstance(i, int) and not isinstance(i, bool) and first - 1 <= i <= last
                                      for i in layers) or layers != sorted(set(layers)):
                raise ValueError(f"{where}: layers {layers} must be distinct, increasing and in {first - 1} .. {last} "
                                 f"(the tensor's producer and the layers it is the input of), at least one")
            checked = []
            for layer, nbytes in entries:
                checked.append((layer, _check_value(f"boundary_saves[{k}] bytes of layer {layer}", nbytes)))
                if nbytes > activation_bytes[layer]:
                    raise ValueError(f"{where}: layer {layer} saves {nbytes!r} bytes of it, more than its "
                                     f"activation_bytes {activation_bytes[layer]!r}")
            result.append((first, last, tuple(checked)))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith("LayerProfile."):
            raise
        raise ValueError(f"LayerProfile.boundary_saves must be (first, last, ((layer, bytes), ...)) per tensor, "
                         f"got {saves!r}") from None
    return tuple(result)


def _starts(balance, num_layers: int) -> list[int]:
    counts = None if isinstance(balance, (str, bytes)) else [as_int(b) for b in balance]
    if counts is None or not all(b is not None and b >= 1 for b in counts):
        raise ValueError(f"balance must be a sequence of layer counts >= 1, got {balance!r}")
    balance = counts  # plain ints (numpy integers accepted)
    if sum(balance) != num_layers:
        raise ValueError(f"balance={list(balance)} sums to {sum(balance)} but the profile has {num_layers} layers")
    starts = [0]
    for count in balance:
        starts.append(starts[-1] + count)
    return starts

