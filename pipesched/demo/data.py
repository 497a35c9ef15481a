"""The demo's batches: random windows of bytes of the corpus (:mod:`pipesched.demo.corpus`)."""
from __future__ import annotations

import torch


def batches(corpus: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """Endless random (inputs, targets) windows: two (B, T) int64 tensors, targets shifted by one."""
    while True:
        starts = torch.randint(len(corpus) - context - 1, (batch,), generator=generator)  # (B,)
        window = torch.stack([corpus[s : s + context + 1] for s in starts.tolist()])  # (B, T+1)
        yield window[:, :-1], window[:, 1:]


def batch_at(corpus: torch.Tensor, batch: int, context: int, seed: int):
    """One batch of random windows drawn with ``torch.Generator().manual_seed(seed)``: (B, T) inputs and targets.
    Seeding each step's batch by the step makes a resumed run draw exactly the batches an unbroken one would."""
    return next(batches(corpus, batch, context, torch.Generator().manual_seed(seed)))
