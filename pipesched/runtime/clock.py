"""Clocks for the measured timeline: host time on CPU, CUDA events on a GPU.

A clock hands out *marks* while a step runs and turns them into seconds from the step's start only when a
timeline is asked for, so recording never waits for the device. On CPU a mark is ``time.perf_counter()``.
On CUDA a mark is an event recorded on the current stream: it completes when the GPU reaches that point,
so an instruction's span is when the GPU ran it, not when the host queued it (a compute mark recorded
after waiting for a receive completes only once the received data is there).
"""
from __future__ import annotations

import time

import torch


#: the widest bracket (seconds between the two marks around the wall-clock reading) :func:`bracketed` accepts at once
BRACKET_S = 50e-6
BRACKET_TRIES = 5  # brackets :func:`bracketed` takes at most before it keeps the narrowest


def bracketed(mark, wall, width: float = BRACKET_S, tries: int = BRACKET_TRIES) -> tuple[float, float]:
    """``(mark, wall clock)`` taken at one instant: ``mark()``, ``wall()``, ``mark()`` again, retried while the two
    marks are more than ``width`` seconds apart (the process was preempted in between: pairing the wall clock with
    either mark would shift every event aligned by it), at most ``tries`` times; returns the midpoint of the two
    marks of the first bracket within ``width`` (else of the narrowest) and the wall clock read inside it."""
    best = None
    for _ in range(tries):
        before, at, after = mark(), wall(), mark()
        if best is None or after - before < best[0]:
            best = (after - before, (before + after) / 2, at)
        if after - before <= width:
            break
    return best[1], best[2]


class HostClock:
    """``time.perf_counter`` marks (for CPU devices)."""

    name = "time.perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def origin(self) -> tuple[float, float]:
        """A step's start: ``(mark, time.time())`` at one instant (:func:`bracketed`), so that the ranks' timelines,
        aligned by their wall clocks, keep a send before its receive."""
        return bracketed(time.perf_counter, time.time)

    def seconds(self, origin: float, marks) -> list[float]:
        """Seconds from ``origin`` (a mark: the step's start), one per mark."""
        return [m - origin for m in marks]


class CudaClock:
    """CUDA event marks on ``device``'s current stream."""

    name = "cuda events"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def origin(self) -> tuple:
        """A step's start: ``(mark, time.time())``. Not bracketed: an event's time is when the GPU reaches it, which
        the host cannot read without waiting for the stream (the pair is off by the work still queued anyway)."""
        return self.mark(), time.time()

    def seconds(self, origin, marks) -> list[float]:
        """Seconds from ``origin`` (a mark: the step's start), one per mark; waits for the events to complete."""
        for event in marks:
            event.synchronize()
        return [origin.elapsed_time(event) / 1e3 for event in marks]  # elapsed_time is in ms


def clock_for(device: torch.device):
    """The clock for a stage on ``device``: CUDA events on a CUDA device, host time otherwise."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
