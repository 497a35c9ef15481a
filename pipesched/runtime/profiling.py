"""Measure a model's layers (seconds and bytes per microbatch): the :class:`~pipesched.profile.LayerProfile` that
``Pipeline(balance="time")`` and the planner read; the link between two ranks is measured by :func:`profile_link`
(:mod:`~pipesched.runtime.link_profile`, importable from here too)."""
from __future__ import annotations

import statistics
import time
import warnings

import torch

from ..checks import MAX_RUNS, as_int, described, short
from ..profile import LayerProfile
from .loss import needs_target
from .accounting import SavedBytes, tensor_bytes
from .link_profile import Link, profile_link  # noqa: F401 - importable from here, as before
from .microbatch import as_tuple, as_value, cloned, stage_output
from .recompute import own_generators, scratch_buffers, states_kept
from .split import backward_input, backward_weight
from .stage import layers_of


def profile_layers(model, sample_input, target=None, loss_fn=None, repeat: int = 5, warmup: int = 1,
                   sizes=None) -> LayerProfile:
    """Run the layers of ``model`` one by one in this process on one microbatch and measure each.

    Per layer, as the pipeline runs a stage of it: the forward; the input-gradient half of the backward (``I``)
    and the weight-gradient half (``W``), split as the runtime splits them (:mod:`pipesched.runtime.split`;
    a layer whose input needs no gradient, like the first, has ``I`` = 0 and its whole backward in ``W``); the
    median of ``repeat`` timed runs after ``warmup`` untimed ones (seconds; on CUDA with events and
    synchronisation; on a CPU with one intra-op thread, ``torch.get_num_threads() == 1`` as a rank of the
    runtime runs, the thread's CPU time: what the work costs a core of its own, not the time it waited for a
    core that other processes held, so a profile taken on a busy shared machine is still the layers'; else wall
    time). The output gradient is all ones; the last layer's backward starts from
    ``loss_fn(output, target)`` (``loss_fn(output)`` without a target), whose forward counts in that layer.

    The same is timed again on the first rows of the sample for each smaller size of ``sizes``, and per layer
    and time a line ``time = fixed + slope x samples`` is fitted (least squares): its intercept, clipped to
    ``[0, the sample's time]``, is the layer's fixed seconds (``forward_fixed``, ``input_grad_fixed``,
    ``weight_grad_fixed``), which :meth:`~pipesched.profile.LayerProfile.scaled` keeps when it scales to
    smaller microbatches (a 1-sample microbatch still pays every op's dispatch).

    Leaves no trace: parameters' ``.grad`` are as before (``None`` stays ``None``), buffers (BatchNorm's running
    statistics, ``num_batches_tracked``) are untouched (the layers run on scratch copies), and the torch RNG
    states (CPU and the CUDA devices of the parameters, and any ``torch.Generator`` a layer holds as an attribute)
    are restored, so what runs after is bitwise what would have run without profiling.

    Args:
        model: an ``nn.Sequential`` (or list of modules), on the device to measure.
        sample_input: one microbatch: a tensor ``(microbatch_size, ...)`` or a tuple of them, on that device.
        target, loss_fn: as for :class:`~pipesched.runtime.Pipeline`; without ``loss_fn`` the last layer's
            backward starts from its outputs with all-ones gradients. A ``target`` tensor with as many rows as
            the sample is cut like it for the smaller sizes (any other target is passed whole).
        repeat: timed runs per measurement (>= 1); warmup: untimed runs before them (>= 0).
        sizes: microbatch sizes (ints in ``[1, microbatch_size]``) to time besides the sample's own, for the fixed
            parts; ``None``: a quarter of the sample (rounded down, at least 1), none for a 1-row sample;
            ``()``: none (the fixed parts are 0: time in proportion to the samples). With ``sizes=None``, a
            model that cannot run on fewer rows (BatchNorm on 1 row) gets a warning and fixed parts 0.
    Returns:
        A :class:`~pipesched.profile.LayerProfile` with ``microbatch_size`` the sample's dim 0, its times those
        of the whole sample, the fixed parts, bytes (``activation_bytes``: tensors saved for backward, counted as
        the runtime counts them, parameters excluded; ``output_bytes``: numel x itemsize of the output tensors;
        ``param_bytes``; ``input_bytes``: all the sample's tensors), ``boundary_saves`` (which layers save each
        tensor passed between layers, by address: one tensor saved by several layers of a stage counts once in
        :meth:`~pipesched.profile.LayerProfile.costs`, as ``stage_activation_bytes`` counts it), the layers' class
        names and the device; no link (``latency`` 0, ``bandwidth`` inf: see :func:`profile_link`).
    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``/list of modules, ``sample_input`` not a tensor or tuple
            of tensors, ``loss_fn`` not callable. ValueError: ``repeat`` not in 1..MAX_RUNS or ``warmup`` not in
            0..MAX_RUNS (:data:`pipesched.checks.MAX_RUNS`: far past any use, short of never finishing); ``sizes`` not
            ints in ``[1, microbatch_size]``; a layer's output (not the last's) is not a tensor or tuple of
            tensors; ``loss_fn`` takes a target and ``target`` is None; ``loss_fn`` raised on a ``target`` whose first
            (batch) dimension is not the model output's (names both shapes; the loss's error is the ``__cause__``).
    Warns:
        UserWarning: on a CPU with more than one intra-op thread (times by wall clock; see above).
    """
    layers = layers_of(model)
    repeat, warmup = _run_counts(repeat, warmup)
    _check_loss_fn(loss_fn, target)
    inputs, container = as_tuple(sample_input, "sample_input")
    n = int(inputs[0].shape[0])
    smaller = _smaller_sizes(sizes, n)
    params = [p for layer in layers for p in layer.parameters()]
    device = params[0].device if params else inputs[0].device
    cuda = sorted({t.device for t in params + list(inputs) if t.device.type == "cuda"}, key=str)
    if device.type != "cuda" and torch.get_num_threads() > 1:
        _warn_wall_clock()
    grads = [p.grad for p in params]  # restored at the end; the measured backwards accumulate into fresh ones
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=cuda), states_kept(own_generators(torch.nn.ModuleList(layers))), \
                scratch_buffers(torch.nn.ModuleList(layers)), torch.enable_grad():
            rows, boundary_saves = _run_layers(layers, inputs, container, loss_fn, target, repeat, warmup, device)
            timings = {n: [row[:3] for row in rows]}
            _time_smaller(timings, smaller, sizes, layers, inputs, container, loss_fn, target, repeat, warmup, device)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return _layer_profile(layers, rows, timings, boundary_saves, inputs, device)


def _run_counts(repeat, warmup) -> tuple[int, int]:
    """``repeat`` and ``warmup`` as plain ints (numpy integers accepted), checked (see :func:`profile_layers`)."""
    counts = []
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0)):
        counts.append(as_int(value))
        if counts[-1] is None or counts[-1] < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if counts[-1] > MAX_RUNS:  # a huge count would never finish
            raise ValueError(f"{name} must be an int {low}..{MAX_RUNS:,} (runs per measurement), got {short(value)}")
    return counts[0], counts[1]


def _check_loss_fn(loss_fn, target) -> None:
    """Refuse a ``loss_fn`` that is not callable, or that takes a target when ``target`` is None."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {described(loss_fn)}")
    if loss_fn is not None and target is None and needs_target(loss_fn):
        raise ValueError("profile_layers: loss_fn takes (output, target) but target is None: pass target= (a "
                         "microbatch's target, as for the sample)")


def _warn_wall_clock() -> None:
    """Warn (at :func:`profile_layers`'s caller) that the layers are timed by wall clock."""
    warnings.warn(f"profile_layers: torch runs {torch.get_num_threads()} intra-op threads in this process, so "
                  f"the layers are timed by wall clock, which another process's load inflates at random (a "
                  f"balance='time' cut or a plan from it can come out lopsided); a pipeline's ranks run one "
                  f"thread (pipesched.runtime.launch, torchrun's OMP_NUM_THREADS=1): call "
                  f"torch.set_num_threads(1) first to time the layers as they run there, by CPU time",
                  stacklevel=3)


def _time_smaller(timings: dict, smaller, sizes, layers, inputs, container, loss_fn, target, repeat, warmup,
                  device) -> None:
    """Time the first rows of the sample for each size of ``smaller`` into ``timings`` (size -> per layer: the
    three times); with ``sizes=None`` a size the model cannot run on is warned about and left out."""
    n = int(inputs[0].shape[0])
    for size in smaller:
        cut = tuple(t[:size] for t in inputs)
        cut_target = target[:size] if isinstance(target, torch.Tensor) and target.dim() \
            and target.shape[0] == n else target
        try:
            timings[size] = [row[:3] for row in _run_layers(layers, cut, container, loss_fn, cut_target,
                                                            repeat, warmup, device)[0]]
        except (RuntimeError, ValueError) as exc:
            if sizes is not None:
                raise
            warnings.warn(f"profile_layers: the model does not run on {size} of the sample's {n} rows "
                          f"({exc}); fixed parts left at 0 (pass sizes= to choose others)", stacklevel=3)


def _layer_profile(layers, rows, timings: dict, boundary_saves, inputs, device) -> LayerProfile:
    """The :class:`~pipesched.profile.LayerProfile` of the measured ``rows`` (and ``timings`` for the fixed parts)."""
    n = int(inputs[0].shape[0])
    columns = list(zip(*rows))
    fixed = _fixed_parts(timings, n)
    return LayerProfile(forward=columns[0], input_grad=columns[1], weight_grad=columns[2],
                        activation_bytes=columns[3], output_bytes=columns[4], param_bytes=columns[5],
                        microbatch_size=n, input_bytes=float(tensor_bytes(inputs)), boundary_saves=boundary_saves,
                        layer_names=tuple(type(layer).__name__ for layer in layers), device=str(device),
                        forward_fixed=fixed[0], input_grad_fixed=fixed[1], weight_grad_fixed=fixed[2])


def _smaller_sizes(sizes, n: int) -> tuple[int, ...]:
    """The sizes other than ``n`` to time (see ``profile_layers``'s ``sizes``)."""
    if sizes is None:
        return (n // 4,) if n // 4 >= 1 and n // 4 != n else ((1,) if n > 1 else ())
    counts = [None] if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__") \
        else [as_int(k) for k in sizes]  # plain ints (numpy integers accepted)
    if not all(k is not None and 1 <= k <= n for k in counts):
        raise ValueError(f"sizes must be ints in [1, {n}] (the sample's rows), got {sizes!r}")
    return tuple(sorted(set(counts) - {n}))


def _run_layers(layers, inputs, container, loss_fn, target, repeat, warmup, device) -> tuple[list[tuple], tuple]:
    """``(rows, boundary_saves)``: per layer, ``_measure``'s row, each layer fed the previous one's output (the
    output of its counted run, so that the tensors passed keep their addresses); and the
    :attr:`~pipesched.profile.LayerProfile.boundary_saves` of the layers: which layers save each tensor that passes
    between layers (found by address, as :class:`~pipesched.runtime.accounting.SavedBytes` tells tensors apart:
    in a stage, one tensor that two layers save counts once)."""
    rows = []
    groups = []  # per tensor that passes between layers: [first receiver, last receiver, {layer: bytes}]
    current = {t.data_ptr(): _new_group(groups, 0) for t in inputs}  # address -> group, of this layer's inputs
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        row, out, seen = _measure(layer, inputs, container, (loss_fn, target) if last else None, repeat, warmup,
                                  device)
        rows.append(row)
        for ptr, group in current.items():
            groups[group][1] = i
            if ptr in seen:
                groups[group][2][i] = seen[ptr]
        if not last:
            inputs, container = stage_output(out, i)
            passed = {}
            for t in inputs:  # the same address as an input: passed on (nn.Identity, a view); else a new tensor
                ptr = t.data_ptr()
                if ptr not in passed:
                    passed[ptr] = current[ptr] if ptr in current else _new_group(groups, i + 1)
                    if ptr not in current and ptr in seen:  # the layer saves its output
                        groups[passed[ptr]][2][i] = seen[ptr]
            current = passed
            inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)  # as the next stage gets it
            del out  # the counted run's graph, never run backward: free its saved tensors now
    boundary_saves = tuple((first, last_receiver, tuple((layer, float(nbytes)) for layer, nbytes in sorted(
        saves.items()))) for first, last_receiver, saves in groups if saves)
    return rows, boundary_saves


def _new_group(groups: list, first: int) -> int:
    groups.append([first, first, {}])
    return len(groups) - 1


def _fixed_parts(timings: dict, n: int) -> tuple[tuple[float, ...], ...]:
    """Per time (F, I, W) and layer, the intercept of the least-squares line through ``(size, seconds)`` over
    ``timings`` (``{size: [(F, I, W) per layer]}``), clipped to ``[0, the time at n]``; 0 with one size."""
    sizes = sorted(timings)
    result = []
    for kind in range(3):
        column = []
        for layer, row in enumerate(timings[n]):
            points = [(k, timings[k][layer][kind]) for k in sizes]
            column.append(min(max(_intercept(points), 0.0), row[kind]) if len(points) > 1 else 0.0)
        result.append(tuple(column))
    return tuple(result)


def _intercept(points) -> float:
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x


def _measure(layer, inputs, container, loss, repeat, warmup, device):
    """``((forward, I, W seconds, saved, output, parameter bytes), output, {address: bytes saved})`` of one layer;
    the output and the saved bytes per address are those of the same (counted) run."""
    params = [p for p in layer.parameters() if p.requires_grad]
    counter = SavedBytes(layer.parameters())
    arg = as_value(inputs, container)

    fresh = [False]  # a layer that works in place on its input gets a copy (see below)

    def forward():
        out = layer(cloned(arg) if fresh[0] else arg)
        root = out
        if loss is not None and loss[0] is not None:
            root = _loss(loss[0], out, loss[1])
        return out, root

    try:
        with counter.track():
            counted, root = forward()
    except RuntimeError as exc:
        # e.g. nn.ReLU(inplace=True): alone, its input is a leaf that needs a gradient, which autograd does not let
        # change in place; inside a stage it gets the previous layer's output, which it may. Time it on a copy
        # (one memcpy more), as Pipeline runs it anywhere but first in a stage.
        if "in-place operation" not in str(exc) or "leaf" not in str(exc):
            raise
        fresh[0] = True
        counter = SavedBytes(layer.parameters())
        with counter.track():
            counted, root = forward()
    by_address = counter.by_address()  # what take() sums: per address, the bytes saved there
    saved = counter.take()
    f_times, i_times, w_times = [], [], []
    for run in range(warmup + repeat):
        f, (out, root) = _timed(forward, device)
        roots = [t for t in as_tuple(root)[0] if t.requires_grad] if isinstance(root, (torch.Tensor, tuple, list)) \
            else []
        seeds = None if loss is not None and loss[0] is not None else [torch.ones_like(t) for t in roots]
        b_i, (_, work) = _timed(lambda: backward_input(roots, seeds, inputs, params), device)
        b_w, _ = _timed(lambda: backward_weight(work), device)
        for p in params:
            p.grad = None
        if run >= warmup:
            f_times.append(f), i_times.append(b_i), w_times.append(b_w)
    outputs = as_tuple(out)[0] if isinstance(out, (torch.Tensor, tuple, list)) else ()
    output_bytes = tensor_bytes(t for t in outputs if isinstance(t, torch.Tensor))
    return (statistics.median(f_times), statistics.median(i_times), statistics.median(w_times) if params else 0.0,
            float(saved), float(output_bytes), float(tensor_bytes(layer.parameters()))), counted, by_address


def _loss(loss_fn, out, target):
    """``loss_fn(out, target)`` (``loss_fn(out)`` without a target). A loss that raises on a ``target`` whose first
    (batch) dimension is not ``out``'s gets a ValueError naming both shapes, its own error chained; any other error
    is the loss's own."""
    if target is None:
        return loss_fn(out)
    try:
        return loss_fn(out, target)
    except Exception as exc:  # noqa: BLE001 - torch's RuntimeError or ValueError, or a user loss's own
        tensors = isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor) and out.dim() and target.dim()
        if not tensors or out.shape[0] == target.shape[0]:
            raise
        raise ValueError(f"profile_layers: target has shape {tuple(target.shape)} but the model's output has shape "
                         f"{tuple(out.shape)}: their first (batch) dimensions differ ({target.shape[0]} vs "
                         f"{out.shape[0]}), and loss_fn raised {type(exc).__name__}; pass the target of the sample "
                         f"(one row per sample_input row)") from exc


def _timed(fn, device):
    """``(seconds, fn())``: CUDA events on a CUDA device; on a CPU with one intra-op thread, this thread's CPU
    time (the work, not the waits for a core that other processes hold; the CPU autograd engine runs the
    backward on the calling thread); else wall time."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3, result
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    begin = clock()
    result = fn()
    return clock() - begin, result
