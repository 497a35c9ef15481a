"""A rank's random number generator states, for an exact resume: torch's CPU generator, the CUDA generator of the
stages' device (if on one), Python's ``random`` and NumPy's global generator (if NumPy is installed)."""
from __future__ import annotations

import random

import torch


def _numpy():
    try:
        import numpy
    except ImportError:  # optional
        return None
    return numpy


def capture(device: torch.device) -> dict[str, object]:
    """This process's generator states: ``"torch"`` (uint8 tensor), ``"cuda"`` (uint8 tensor, when ``device`` is a
    CUDA device), ``"python"`` (``random.getstate()``), ``"numpy"`` (``numpy.random.get_state()``)."""
    states: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    numpy = _numpy()
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def placeholders(device: torch.device, available) -> dict[str, object]:
    """Values of the right kind for a checkpoint load of :func:`capture`'s entries that ``available`` (names) has."""
    out = {key: value for key, value in capture(device).items() if key in available}
    return {key: (torch.empty_like(value) if isinstance(value, torch.Tensor) else None) for key, value in out.items()}


def restore(states: dict[str, object], device: torch.device) -> None:
    """Set this process's generators to ``states`` (as :func:`capture` returned them; absent ones are left alone)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    if "python" in states:
        random.setstate(states["python"])
    numpy = _numpy()
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])
