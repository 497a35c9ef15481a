"""Measure the link between two ranks: message latency (seconds), bandwidth (bytes/s) and the send call's own time
(seconds), by ping-pongs with receives posted ahead: what a :class:`~pipesched.profile.LayerProfile`'s ``latency``,
``bandwidth`` and ``send_overhead`` hold (:func:`profile_link`)."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..checks import MAX_RUNS, as_int, described, short


#: :func:`profile_link`'s largest message, bytes (1 GiB; why: its docstring)
MAX_NBYTES = 1 << 30


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
        nbytes: message sizes in bytes, >= 2 distinct ints in 1..:data:`MAX_NBYTES` (1 GiB; any sequence, a numpy
            array too): each of the two ranks holds three buffers of a size (the message and two posted
            receives), and a pipeline's messages are far smaller; a larger size is a typo (``10**15`` bytes would
            fail to allocate, or run for hours).
        repeat: round trips per size, 1..:data:`~pipesched.checks.MAX_RUNS` (10,000, as ``profile_layers``'s):
            the median round trip settles within tens, and every rank gathers ``2 x repeat`` send times; a larger
            value is a typo (``repeat=10**9`` would allocate 16 GB, then ping-pong for days).
        device: where the messages live (default: the current CUDA device on NCCL, else the CPU).
    Returns:
        A :class:`Link` ``(latency, bandwidth, send_overhead)``, the same floats on every rank of the group.
    Raises:
        RuntimeError: torch.distributed is not initialised. TypeError: ``group`` is not a process group.
        ValueError: the group has fewer than 2 ranks; bad ``nbytes``, ``repeat`` or ``device`` on any rank of the
            group, or ranks that passed different ``nbytes`` or ``repeat`` (on every rank of the group, after one
            small all-gather of each rank's checked arguments and before any message of the measurement: gloo
            aborted the process on the ping-pong's mismatched sizes).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("profile_link needs torch.distributed initialised (pipesched.runtime.launch or torchrun)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"profile_link: group must be None (the default group) or a torch.distributed ProcessGroup, "
                        f"got {described(group)}")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if len(ranks) < 2:
        raise ValueError(f"profile_link needs a group of at least 2 ranks, got {len(ranks)}")
    try:
        sizes, repeat, device = _checked(nbytes, repeat, device, group)
        mine = {"nbytes": sizes, "repeat": repeat}
    except ValueError as exc:  # the other ranks must hear of it, not wait in the ping-pong
        refusal, mine = exc, {"error": str(exc)}
    with _object_device(device, group):  # NCCL: all_gather_object's tensors go to the current CUDA device
        _agree(mine, ranks, group)
    if "error" in mine:
        raise refusal
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


def _checked(nbytes, repeat, device, group) -> tuple[list, int, torch.device]:
    """This rank's checked ``(sizes, repeat, device)`` (:func:`profile_link`'s arguments); ValueError naming each."""
    sequence = not isinstance(nbytes, (str, bytes, dict)) and hasattr(nbytes, "__iter__")  # a numpy array too
    sizes = [as_int(n) for n in nbytes] if sequence else []  # numpy integers: plain ints
    if len(set(sizes)) < 2 or not all(n is not None and 0 < n <= MAX_NBYTES for n in sizes):
        raise ValueError(f"nbytes must hold >= 2 distinct ints 1..{MAX_NBYTES:,} (bytes of a message; at most "
                         f"1 GiB), got {short(nbytes)}")
    if as_int(repeat) is None or not 1 <= repeat <= MAX_RUNS:  # a huge count would never finish
        raise ValueError(f"repeat must be an int 1..{MAX_RUNS:,} (round trips per size), got {short(repeat)}")
    if device is None:
        return sorted(set(sizes)), as_int(repeat), (torch.device("cuda", torch.cuda.current_device())
                                                    if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    try:
        return sorted(set(sizes)), as_int(repeat), torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None


def _object_device(device, group):
    """A context making ``device`` the current CUDA device around the arguments' all-gather on an NCCL group:
    ``all_gather_object`` puts its tensors on the current device, so a caller passing ``device="cuda:1"`` without
    ``torch.cuda.set_device(1)`` would meet the others on cuda:0 (two ranks on one GPU: NCCL fails or hangs), while
    the ping-pong ran on cuda:1. A no-op for gloo, ``device=None`` (the current device already) or a bad ``device``
    (refused after the all-gather; the current device then)."""
    if device is None or dist.get_backend(group) != "nccl":
        return contextlib.nullcontext()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return contextlib.nullcontext()
    if device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _agree(mine: dict, ranks: list, group) -> None:
    """One all-gather of every rank's checked arguments (or its refusal) over ``group``: raise on every rank when a
    rank refused (quotes it; the refusing rank raises its own error) or when ranks passed different ones.

    Raises:
        ValueError: names the first other refusing rank and its message, or the first rank whose ``nbytes`` or
            ``repeat`` differ from this rank's, with both values.
    """
    rows: list = [None] * len(ranks)
    dist.all_gather_object(rows, mine, group=group)
    me = dist.get_rank()
    for rank, row in zip(ranks, rows):
        if "error" in row and rank != me and "error" not in mine:
            raise ValueError(f"profile_link: rank {rank} refused its arguments: {row['error']}")
    for rank, row in zip(ranks, rows):
        if "error" not in mine and "error" not in row and row != mine:
            raise ValueError(f"profile_link: rank {rank} passed nbytes={row['nbytes']}, repeat={row['repeat']} but "
                             f"rank {me} nbytes={mine['nbytes']}, repeat={mine['repeat']}; every rank of the group "
                             f"must pass the same")


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
