"""Buffers used by stages on different pipeline ranks: one module object (or one buffer tensor) at two places of the
model, e.g. a ``BatchNorm`` reused at layers 1 and 4 cut onto two ranks. Tied *parameters* are summed
(:mod:`~pipesched.runtime.ties`); a buffer is not: each rank's forward would update only its own copy, so its values
(and ``eval()`` outputs, and what a checkpoint holds) would silently differ from the unsplit model's, which applies
every use's update to the one buffer. So a module known to update its buffers in training (a norm layer tracking
running statistics) is refused at construction, and any other such buffer is checked around each ``step()`` and
``forward()``: a buffer that changed on a rank ends the job with an error naming it. Buffers that never change (a
rotary or positional table shared by many layers) cost one ``clone`` per step each and are otherwise free."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn

from .stage import layer_starts


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")  # torch's norm layers' (and their kind's)


class SharedBuffer(NamedTuple):
    """A buffer used by stages on two pipeline ranks or more: its names in the unsplit model (``"1.running_mean"``,
    ``"4.running_mean"``), the stages and ranks using it, and where this rank finds it (``owner._buffers[key]``)."""

    names: tuple[str, ...]
    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    owner: nn.Module
    key: str

    def tensor(self):
        return self.owner._buffers[self.key]


def cross_rank_buffers(layers: Sequence[nn.Module], balance: Sequence[int], stage_to_rank) -> list[SharedBuffer]:
    """Every buffer (by identity) that stages on two pipeline ranks or more use, in the order of its first use."""
    starts = layer_starts(balance)
    uses: dict[int, list] = {}  # id(buffer) -> [(name, stage, owner, key)]
    for stage in range(len(balance)):
        for index in range(starts[stage], starts[stage + 1]):
            for path, owner in layers[index].named_modules(remove_duplicate=False):
                for key, tensor in owner._buffers.items():
                    if tensor is not None:
                        name = ".".join(p for p in (str(index), path, key) if p)
                        uses.setdefault(id(tensor), []).append((name, stage, owner, key))
    shared = []
    for found in uses.values():
        ranks = tuple(sorted({stage_to_rank[stage] for _, stage, _, _ in found}))
        if len(ranks) > 1:
            shared.append(SharedBuffer(tuple(dict.fromkeys(n for n, *_ in found)),
                                       tuple(sorted({s for _, s, _, _ in found})), ranks, found[0][2], found[0][3]))
    return shared


def refuse_running_stats(shared: Sequence[SharedBuffer]) -> None:
    """Refuse a norm layer that tracks running statistics (``BatchNorm``, ``InstanceNorm(track_running_stats=True)``)
    used by stages on different ranks, before any communication.

    Raises:
        ValueError: names the buffer's names in the unsplit model, the module's class, the stages and ranks.
    """
    for buffer in shared:
        if getattr(buffer.owner, "track_running_stats", False) is True and buffer.key in _RUNNING_STATS:
            raise ValueError(f"{describe(buffer)}: {type(buffer.owner).__name__} updates it in every training "
                             f"forward, and each rank would update only its own copy (buffers are not summed like "
                             f"tied parameters), so its running statistics would differ from the unsplit model's; "
                             f"put its uses on one rank (balance=), or give each use its own module")


def describe(buffer: SharedBuffer) -> str:
    return (f"buffer {' = '.join(repr(n) for n in buffer.names)} is used by stages {list(buffer.stages)} on "
            f"pipeline ranks {list(buffer.ranks)}")


def snapshot(shared: Sequence[SharedBuffer]) -> list:
    """This rank's copies' values now (clones), for :func:`check_unchanged` after the step."""
    with torch.no_grad():
        return [buffer.tensor().detach().clone() for buffer in shared]


def check_unchanged(shared: Sequence[SharedBuffer], before: Sequence) -> None:
    """Raises:
        RuntimeError: a shared buffer changed during the step on this rank (names it, its stages and ranks); the
            Pipeline then ends every rank with a ``PipelineError`` naming this rank as the origin.
    """
    for buffer, value in zip(shared, before):
        if not _same(buffer.tensor(), value):
            raise RuntimeError(f"{describe(buffer)}, and this rank's forward changed it: the other ranks' copies "
                               f"did not change alike (buffers are not summed like tied parameters), so its values "
                               f"would differ from the unsplit model's; put its uses on one rank (balance=), or give "
                               f"each use its own buffer")


def _same(now, before) -> bool:
    """Equal shapes, dtypes and values (a NaN equal to a NaN: a buffer holding one has not changed)."""
    if now is None or now.shape != before.shape or now.dtype != before.dtype:
        return False
    if now.is_floating_point() or now.is_complex():
        return bool(torch.allclose(now, before, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(now, before))
