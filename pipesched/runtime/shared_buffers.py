"""Buffers used by stages on different pipeline ranks: one module object (or one buffer tensor) at two places of the
model, e.g. a ``BatchNorm`` reused at layers 1 and 4 cut onto two ranks. Tied *parameters* are summed
(:mod:`~pipesched.runtime.ties`); a buffer is not: each rank's forward would update only its own copy, so its values
(and ``eval()`` outputs, and what a checkpoint holds) would silently differ from the unsplit model's, which applies
every use's update to the one buffer. So a module known to update its buffers in training (a norm layer tracking
running statistics) used by two stages is refused at construction (on one rank too: its stages would update it in
another order), and any other buffer shared across ranks is checked around each ``step()`` and ``forward()``: a
buffer that changed on a rank ends the job with an error naming it (a peer whose step had ended learns it at its
next call). Buffers that never change (a
rotary or positional table shared by many layers) cost one ``clone`` per step each and are otherwise free."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn

from .stage import stage_of_each_layer


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


def shared_buffers(layers: Sequence[nn.Module], balance: Sequence[int], stage_to_rank) -> list[SharedBuffer]:
    """Every buffer (by identity) that two stages or more use, in the order of its first use (the ranks may be one:
    ``zbv`` holds stages 0 and ``2p - 1`` on rank 0)."""
    uses: dict[int, list] = {}  # id(buffer) -> [(name, stage, owner, key)]
    for stage, index in stage_of_each_layer(balance):
        for path, owner in layers[index].named_modules(remove_duplicate=False):
            for key, tensor in owner._buffers.items():
                if tensor is not None:
                    name = ".".join(p for p in (str(index), path, key) if p)
                    uses.setdefault(id(tensor), []).append((name, stage, owner, key))
    shared = []
    for found in uses.values():
        stages = tuple(sorted({stage for _, stage, _, _ in found}))
        if len(stages) > 1:
            shared.append(SharedBuffer(tuple(dict.fromkeys(n for n, *_ in found)), stages,
                                       tuple(sorted({stage_to_rank[s] for s in stages})), found[0][2], found[0][3]))
    return shared


def checked_on(shared: Sequence[SharedBuffer], pp_rank: int) -> list[SharedBuffer]:
    """The buffers of ``shared`` that :func:`check_unchanged` watches on pipeline rank ``pp_rank``: those used on
    two ranks or more, this one among them (on one rank the stages share one copy)."""
    return [b for b in shared if len(b.ranks) > 1 and pp_rank in b.ranks]


def refuse_running_stats(shared: Sequence[SharedBuffer]) -> None:
    """Refuse a norm layer that tracks running statistics (``BatchNorm``, ``InstanceNorm(track_running_stats=True)``)
    used by two stages or more, before any communication: on two ranks each would update only its own copy; on one
    rank its stages run a microbatch's uses in another order than the unsplit model (a rank runs one stage's
    microbatches before the next stage's), and the running averages depend on the order.

    Raises:
        ValueError: names the buffer's names in the unsplit model, the module's class, the stages and ranks.
    """
    for buffer in shared:
        if getattr(buffer.owner, "track_running_stats", False) is True and buffer.key in _RUNNING_STATS:
            why = ("each rank would update only its own copy (buffers are not summed like tied parameters)"
                   if len(buffer.ranks) > 1 else "its stages would update it in another order than the unsplit "
                   "model (a rank runs one stage's microbatches before the next stage's)")
            raise ValueError(f"{describe(buffer)}: {type(buffer.owner).__name__} updates it in every training "
                             f"forward, and {why}, so its running statistics would differ from the unsplit "
                             f"model's; put its uses in one stage (balance=), or give each use its own module")


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
    if torch.equal(now, before):  # the common case, and ~6x cheaper than the NaN-aware compare
        return True
    return (now.is_floating_point() or now.is_complex()) and bool(
        torch.allclose(now, before, rtol=0, atol=0, equal_nan=True))
