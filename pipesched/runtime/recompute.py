"""Activation recomputation: save the RNG state at the forward, replay it at the recompute (bitwise)."""
from __future__ import annotations

import contextlib

import torch


def rng_state(device: torch.device) -> tuple:
    """``(cpu_state, cuda_state or None)``: what the forward of a recomputed stage must replay."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replay_rng(state: tuple, device: torch.device):
    """Run the block with the RNG state ``state`` (from :func:`rng_state`); restore the caller's RNG after,
    so a recompute does not shift the random numbers of later forwards."""
    cpu, cuda = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _refuse(_):
    raise RuntimeError("the forward of a recomputed stage keeps no activations; backward must follow its R")


def keep_nothing():
    """Record the autograd graph (so outputs know whether they require grad) but save no tensor for backward."""
    return torch.autograd.graph.saved_tensors_hooks(lambda _t: None, _refuse)
