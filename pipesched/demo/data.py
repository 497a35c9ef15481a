"""The demo's batches: random windows of bytes of the corpus (:mod:`pipesched.demo.corpus`)."""
from __future__ import annotations

import torch


def batches(corpus: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """Endless random (inputs, targets) windows: two (B, T) int64 tensors, targets shifted by one."""
    while True:
        starts = torch.randint(len(corpus) - context - 1, (batch,), generator=generator)  # (B,)
        window = torch.stack([corpus[s : s + context + 1] for s in starts.tolist()])  # (B, T+1)
        yield window[:, :-1], window[:, 1:]
