"""Worker of test_saved_hooks_leak.py: layers with a saved_tensors_hooks pair of their own (pack keeps a detached
tensor, as the README asks), trained a few steps under schedules that keep or drop graphs (recompute, split
backward, zero-bubble): how many tensors the layers saved are still alive after each step."""
import gc
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline


class Block(nn.Module):
    """Linear, tanh, Linear; every tensor autograd saves goes through ``pack``, which records a weakref to it."""

    def __init__(self, saved: list) -> None:
        super().__init__()
        self.l1, self.l2, self.saved = nn.Linear(16, 16), nn.Linear(16, 16), saved

    def pack(self, t):
        kept = t.detach()
        self.saved.append(weakref.ref(kept))
        return kept

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            return self.l2(torch.tanh(self.l1(x)))


def live_after_steps(rank, options_list, steps=3):
    out = []
    for options in options_list:
        torch.manual_seed(0)
        saved: list = []
        layers = 4 if options.get("schedule") == "zbv" else 2
        pipe = Pipeline(nn.Sequential(*[Block(saved) for _ in range(layers)]), num_microbatches=4,
                        loss_fn=F.mse_loss, **options)
        x, y = torch.randn(16, 16), torch.randn(16, 16)
        counts = []
        for _ in range(steps):
            pipe.step(x, y)
            gc.collect()
            counts.append(sum(ref() is not None for ref in saved))
        out.append((len(saved) > 0, counts))
        pipe.close()
    return out
