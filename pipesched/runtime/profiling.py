"""Measure a model's layers (seconds and bytes per microbatch) and a link between two ranks: the
:class:`~pipesched.profile.LayerProfile` that ``Pipeline(balance="time")`` and the planner read."""
from __future__ import annotations

import statistics
import time
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..checks import as_int
from ..profile import LayerProfile
from .loss import needs_target
from .accounting import SavedBytes, tensor_bytes
from .microbatch import as_tuple, stage_output
from .recompute import scratch_buffers
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
    states (CPU and the CUDA devices of the parameters) are restored, so what runs after is bitwise what would
    have run without profiling.

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
            of tensors, ``loss_fn`` not callable. ValueError: ``repeat`` < 1 or ``warmup`` < 0; ``sizes`` not
            ints in ``[1, microbatch_size]``; a layer's output (not the last's) is not a tensor or tuple of
            tensors; ``loss_fn`` takes a target and ``target`` is None.
    Warns:
        UserWarning: on a CPU with more than one intra-op thread (times by wall clock; see above).
    """
    layers = layers_of(model)
    counts = []  # repeat, warmup as plain ints (numpy integers accepted)
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0)):
        counts.append(as_int(value))
        if counts[-1] is None or counts[-1] < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    repeat, warmup = counts
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if loss_fn is not None and target is None and needs_target(loss_fn):
        raise ValueError("profile_layers: loss_fn takes (output, target) but target is None: pass target= (a "
                         "microbatch's target, as for the sample)")
    inputs, is_tuple = as_tuple(sample_input, "sample_input")
    n = int(inputs[0].shape[0])
    smaller = _smaller_sizes(sizes, n)
    params = [p for layer in layers for p in layer.parameters()]
    device = params[0].device if params else inputs[0].device
    cuda = sorted({t.device for t in params + list(inputs) if t.device.type == "cuda"}, key=str)
    if device.type != "cuda" and torch.get_num_threads() > 1:
        warnings.warn(f"profile_layers: torch runs {torch.get_num_threads()} intra-op threads in this process, so "
                      f"the layers are timed by wall clock, which another process's load inflates at random (a "
                      f"balance='time' cut or a plan from it can come out lopsided); a pipeline's ranks run one "
                      f"thread (pipesched.runtime.launch, torchrun's OMP_NUM_THREADS=1): call "
                      f"torch.set_num_threads(1) first to time the layers as they run there, by CPU time",
                      stacklevel=2)
    grads = [p.grad for p in params]  # restored at the end; the measured backwards accumulate into fresh ones
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=cuda), scratch_buffers(torch.nn.ModuleList(layers)), torch.enable_grad():
            rows, boundary_saves = _run_layers(layers, inputs, is_tuple, loss_fn, target, repeat, warmup, device)
            timings = {n: [row[:3] for row in rows]}
            for size in smaller:
                cut = tuple(t[:size] for t in inputs)
                cut_target = target[:size] if isinstance(target, torch.Tensor) and target.dim() \
                    and target.shape[0] == n else target
                try:
                    timings[size] = [row[:3] for row in _run_layers(layers, cut, is_tuple, loss_fn, cut_target,
                                                                    repeat, warmup, device)[0]]
                except (RuntimeError, ValueError) as exc:
                    if sizes is not None:
                        raise
                    warnings.warn(f"profile_layers: the model does not run on {size} of the sample's {n} rows "
                                  f"({exc}); fixed parts left at 0 (pass sizes= to choose others)", stacklevel=2)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
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


def _run_layers(layers, inputs, is_tuple, loss_fn, target, repeat, warmup, device) -> tuple[list[tuple], tuple]:
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
        row, out, seen = _measure(layer, inputs, is_tuple, (loss_fn, target) if last else None, repeat, warmup,
                                  device)
        rows.append(row)
        for ptr, group in current.items():
            groups[group][1] = i
            if ptr in seen:
                groups[group][2][i] = seen[ptr]
        if not last:
            inputs, is_tuple = stage_output(out, i)
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


def _measure(layer, inputs, is_tuple, loss, repeat, warmup, device):
    """``((forward, I, W seconds, saved, output, parameter bytes), output, {address: bytes saved})`` of one layer;
    the output and the saved bytes per address are those of the same (counted) run."""
    params = [p for p in layer.parameters() if p.requires_grad]
    counter = SavedBytes(layer.parameters())
    arg = inputs if is_tuple else inputs[0]

    fresh = [False]  # a layer that works in place on its input gets a copy (see below)

    def forward():
        out = layer(_copied(arg) if fresh[0] else arg)
        root = out
        if loss is not None and loss[0] is not None:
            root = loss[0](out, loss[1]) if loss[1] is not None else loss[0](out)
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


def _copied(arg):
    """A copy of a layer's argument (each tensor of a tuple) that is not a leaf: what an in-place layer may change."""
    if isinstance(arg, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in arg)
    return arg.clone()


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


class Link(NamedTuple):
    """What :func:`profile_link` measured, in the units and meaning of the :class:`~pipesched.profile.LayerProfile`
    (and :class:`~pipesched.cost.CostModel`) fields of the same names: ``dataclasses.replace(profile,
    **link._asdict())`` puts all three into a profile."""

    latency: float  #: seconds from the end of the send call to the message's arrival, less bytes / bandwidth
    bandwidth: float  #: bytes per second (``inf``: the time did not grow with the size)
    send_overhead: float  #: seconds the sending rank spends inside its send call (LogP's ``o``)


def profile_link(group=None, nbytes=(1 << 10, 1 << 16, 1 << 20, 1 << 22), repeat: int = 5,
                 device=None) -> Link:
    """Latency (seconds), bandwidth (bytes/s) and send overhead (seconds) of point-to-point messages between the
    first two ranks of ``group``: a collective, every rank of the group calls it and gets the same three numbers.

    The first two ranks of the group send each other messages of ``nbytes`` (a ping-pong, ``repeat`` times per
    size after one untimed warm-up round); each receive is posted before the send it waits for (as the pipeline
    posts its receives early; on NCCL, whose sends and receives to one peer run in order, just before its wait), so
    a send call's time is the sending rank's own. A message's one-way time is half the median round trip, and
    ``time = intercept + bytes / bandwidth`` is fitted by least squares over the sizes: the ``intercept``, or, if
    that is not positive, the least of the sizes' times (the smallest size's, unless noise made a larger one
    quicker); ``bandwidth`` is ``inf`` when the time does not grow with the size (the fitted slope is not
    positive: the intercept is then the times' mean). ``send_overhead`` is the median duration of the ``2 x repeat``
    timed send calls of the smallest size, both ranks' (the send call's growth with the size is in the
    bandwidth). ``latency`` is the intercept less ``send_overhead``, at least 0:
    :class:`~pipesched.cost.CostModel`'s message time counts from the send call's end, so the simulated one-way
    time of a message is ``send_overhead + latency + bytes / bandwidth``, as measured.
    Put them into a profile with ``dataclasses.replace(profile, **link._asdict())``.

    Args:
        group: a process group of >= 2 ranks (``None``: the default group).
        nbytes: message sizes in bytes, >= 2 distinct positive ints.
        repeat: round trips per size, >= 1.
        device: where the messages live (default: the current CUDA device on NCCL, else the CPU).
    Returns:
        A :class:`Link` ``(latency, bandwidth, send_overhead)``, the same floats on every rank of the group.
    Raises:
        RuntimeError: torch.distributed is not initialised. ValueError: the group has fewer than 2 ranks,
            bad ``nbytes`` or ``repeat`` (raised on every rank, before any message).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("profile_link needs torch.distributed initialised (pipesched.runtime.launch or torchrun)")
    sizes = [as_int(n) for n in nbytes] if isinstance(nbytes, (list, tuple)) else []  # numpy integers: plain ints
    if len(set(sizes)) < 2 or not all(n is not None and n > 0 for n in sizes):
        raise ValueError(f"nbytes must hold >= 2 distinct positive ints (bytes), got {nbytes!r}")
    sizes = sorted(set(sizes))
    if as_int(repeat) is None or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    repeat = as_int(repeat)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if len(ranks) < 2:
        raise ValueError(f"profile_link needs a group of at least 2 ranks, got {len(ranks)}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
    me, (a, b) = dist.get_rank(), ranks[:2]
    # rank a's fit, then a's and b's send calls of the smallest size, each in its own slots (zeros elsewhere): every
    # number is >= 0, so a MAX over the group puts them together exactly, the same floats on every rank
    result = torch.zeros(2 + 2 * repeat, dtype=torch.float64, device=device)
    if me in (a, b):
        early = dist.get_backend(group) != "nccl"
        rounds = [_round_trip(size, me == a, b if me == a else a, repeat, group, device, early) for size in sizes]
        if me == a:
            result[:2] = torch.tensor(_fit(sizes, [trip / 2 for trip, _ in rounds]), dtype=torch.float64)
        slots = slice(2, 2 + repeat) if me == a else slice(2 + repeat, 2 + 2 * repeat)
        result[slots] = torch.tensor(rounds[0][1], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
    intercept, seconds_per_byte, *calls = result.tolist()
    return _link_of(intercept, seconds_per_byte, statistics.median(calls))


def _link_of(intercept: float, seconds_per_byte: float, overhead: float) -> Link:
    """The :class:`Link` of a fit (one-way ``intercept`` seconds, a slope in seconds per byte) and a send overhead
    (seconds): the latency counts from the send call's end (the intercept less the overhead, at least 0)."""
    return Link(max(0.0, intercept - overhead), _bandwidth(seconds_per_byte), overhead)


def _bandwidth(seconds_per_byte: float) -> float:
    """Bytes per second of a fitted slope: ``inf`` when the slope is 0 (the time does not grow with the size)."""
    return 1.0 / seconds_per_byte if seconds_per_byte > 0 else float("inf")


def _round_trip(size, first, peer, repeat, group, device, early=True):
    """``(median round trip, [send call, ...])`` in seconds of ``repeat`` ping-pongs of ``size`` bytes with global
    rank ``peer`` after an untimed one (the round trip is timed on the ``first`` rank only, 0.0 on the other; the
    ``repeat`` send calls are this rank's).

    With ``early`` every receive is posted before the peer can send its message (the first rank posts its next
    pong's after the round's pong arrived, the other its next ping's before it sends the pong; the runtime's
    latency ping, :func:`pipesched.runtime.measured_costs.ping_latency`, does the same), so from the second round on
    every send finds its receive posted and the send call's time is the sender's own; the first round warms up
    (the peer may not have posted yet). Without (NCCL: a receive posted before a send to the same peer would hold
    that send back) each receive is posted just before its wait. The send call is timed alone (the process group's
    ``send``, as the runtime times its ``SEND``); its completion is waited for after the round's receive."""
    pg = group if group is not None else dist.group.WORLD
    local = dist.get_group_rank(pg, peer)
    payload = torch.zeros(size, dtype=torch.uint8, device=device)
    inbox = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]

    def post(run):
        return pg.recv([inbox[run % 2]], local, 0)

    def send():
        start = time.perf_counter()
        work = pg.send([payload], local, 0)
        return work, time.perf_counter() - start

    receive = post(0) if early else None
    times, calls = [], []
    for run in range(repeat + 1):
        ahead = early and run < repeat
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        if first:
            sent, call = send()
            (receive if early else post(run)).wait()
        else:
            (receive if early else post(run)).wait()
            receive = post(run + 1) if ahead else None  # before the pong: the next ping may follow it at once
            sent, call = send()
        sent.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        trip = time.perf_counter() - begin if first else 0.0
        if first:
            receive = post(run + 1) if ahead else None  # before the next ping: its pong finds it posted
        if run:
            times.append(trip)
            calls.append(call)
    return statistics.median(times), calls


def _fit(sizes, times):
    """``(latency, seconds per byte)`` by least squares; latency falls back to the smallest time when the
    intercept is not positive, seconds per byte to 0 when the slope is not."""
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(times) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, times)) / sum((x - mean_x) ** 2 for x in sizes)
    slope = max(slope, 0.0)
    intercept = mean_y - slope * mean_x
    return (intercept if intercept > 0 else min(times)), slope
