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


class HostClock:
    """``time.perf_counter`` marks (for CPU devices)."""

    name = "time.perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

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

    def seconds(self, origin, marks) -> list[float]:
        """Seconds from ``origin`` (a mark: the step's start), one per mark; waits for the events to complete."""
        for event in marks:
            event.synchronize()
        return [origin.elapsed_time(event) / 1e3 for event in marks]  # elapsed_time is in ms


def clock_for(device: torch.device):
    """The clock for a stage on ``device``: CUDA events on a CUDA device, host time otherwise."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
