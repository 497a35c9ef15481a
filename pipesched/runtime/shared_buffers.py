"""Buffers used by stages on different pipeline ranks: one module object (or one buffer tensor) at two places of the
model, e.g. a ``BatchNorm`` reused at layers 1 and 4 cut onto two ranks. Tied *parameters* are summed
(:mod:`~pipesched.runtime.ties`); a buffer is not: each rank's forward would update only its own copy, so its values
(and ``eval()`` outputs, and what a checkpoint holds) would silently differ from the unsplit model's, which applies
every use's update to the one buffer. So a module known to update its buffers in training (a norm layer tracking
running statistics) used by two stages is refused at construction (on one rank too: its stages would update it in
another order), and any other buffer shared across ranks, or by stages of one rank when a step has several
microbatches (the same order problem), is checked around each ``step()`` and ``forward()``: a buffer that changed
on a rank ends the job with an error naming it (a peer whose step had ended learns it at its next call). Buffers that never change (a
rotary or positional table shared by many layers) cost one ``clone`` per step each and are otherwise free.

Sharing is memory, not identity: buffers that are views of one storage (``register_buffer("t", other.table[:])``,
``.view(...)``) with overlapping bytes are one shared buffer (checked, or refused if a norm layer's running
statistics, alike). A parameter over memory that another tensor of the model also covers (a view of another layer's
weight that is not the same ``Parameter``, a buffer over a weight) with uses on two ranks or more is refused at
construction, naming both: only one ``Parameter`` object is a tie (summed across ranks); any other alias would be
updated on one rank only."""
from __future__ import annotations

import itertools
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
    #: every distinct buffer tensor of the group as ``(owner, key)``: one for a buffer object used twice, more for
    #: buffers that are views of one memory (``table[:]``, ``.view(...)``); the first is ``(owner, key)``
    members: tuple = ()

    def tensor(self):
        return self.owner._buffers[self.key]

    def tensors(self) -> list:
        return [owner._buffers[key] for owner, key in self.members or ((self.owner, self.key),)]


def shared_buffers(layers: Sequence[nn.Module], balance: Sequence[int], stage_to_rank,
                   names=None) -> list[SharedBuffer]:
    """Every buffer that two stages or more use, in the order of its first use (the ranks may be one: ``zbv`` holds
    stages 0 and ``2p - 1`` on rank 0). A buffer is one memory, not one tensor object: buffers that are views of one
    storage with overlapping bytes (``register_buffer("t", other.table[:])``) are one shared buffer, named by all
    their names. Raises ``ValueError`` (:func:`_refuse_aliased`) where such memory is also a parameter's, another
    tensor's too, and its uses span ranks (before any communication: every rank builds the same model). ``names``:
    each layer's key in the model (:func:`~pipesched.runtime.stage.layer_names`; ``None``: its index)."""
    shared = []
    for group in storage_groups(layers, balance, names):
        if any(kind == "parameter" for *_, kind in group):
            _refuse_aliased(group, stage_to_rank)
            continue
        stages = tuple(sorted({stage for _, stage, *_ in group}))
        if len(stages) > 1:
            members: dict = {}  # id(buffer) -> (owner, key) of its first use
            for _, _, owner, key, _ in group:
                members.setdefault(id(owner._buffers[key]), (owner, key))
            shared.append(SharedBuffer(tuple(dict.fromkeys(n for n, *_ in group)), stages,
                                       tuple(sorted({stage_to_rank[s] for s in stages})), group[0][2], group[0][3],
                                       tuple(members.values())))
    return shared


def _refuse_aliased(group, stage_to_rank) -> None:
    """Refuse a group of uses of one memory that holds a parameter and another tensor (a parameter that is a view of
    another layer's, a buffer over a weight's memory) used on two pipeline ranks or more: each rank would update
    only its own copy of the memory, which the unsplit model updates once for every tensor over it. One parameter
    object used by several stages is a tie (:mod:`~pipesched.runtime.ties`), and uses on one rank share the memory
    as in the unsplit model: both pass.

    Raises:
        ValueError: names two of the tensors (their names in the unsplit model, stages, ranks) and what to do.
    """
    ranks = sorted({stage_to_rank[stage] for _, stage, *_ in group})
    tensors = {id(owner._parameters[key] if kind == "parameter" else owner._buffers[key]): (name, stage, kind)
               for name, stage, owner, key, kind in group}
    if len(ranks) < 2 or len(tensors) < 2:
        return
    (a, sa, ka), (b, sb, kb) = sorted(tensors.values(), key=lambda t: t[2] != "parameter")[:2]
    raise ValueError(f"{ka} {a!r} (stage {sa}, pipeline rank {stage_to_rank[sa]}) and {kb} {b!r} (stage {sb}, "
                     f"pipeline rank {stage_to_rank[sb]}) are different tensors over the same memory (a view or "
                     f"slice of one another), used on pipeline ranks {ranks}: each rank would update only its own "
                     f"copy, so the values would silently differ from the unsplit model's (only one Parameter object "
                     f"used by several layers is a tie, kept identical across ranks); tie them with the same "
                     f"Parameter object, give each layer its own tensor (.clone()), or put their uses on one rank "
                     f"(balance=)")


def storage_groups(layers: Sequence[nn.Module], balance: Sequence[int], names=None) -> list[list]:
    """Every use of a parameter or buffer, grouped by memory: ``[(name, stage, owner, key, kind), ...]`` per group
    (``kind`` ``"parameter"`` or ``"buffer"``), uses in model order, groups in the order of their first use. One
    tensor's uses are one group; tensors over one storage whose byte ranges overlap join a group (a tensor without
    a storage of its own, such as a sparse or meta one, or an empty one, is grouped by identity only)."""
    uses: dict[int, list] = {}  # id(tensor) -> its uses, in model order: (number, name, stage, owner, key, kind)
    spans: dict[int, tuple] = {}  # id(tensor) -> (storage, first byte, end byte) or None
    number = itertools.count()
    for stage, index in stage_of_each_layer(balance):
        for path, owner in layers[index].named_modules(remove_duplicate=False):
            for kind, slots in (("parameter", owner._parameters), ("buffer", owner._buffers)):
                for key, tensor in slots.items():
                    if tensor is not None:
                        layer = str(index) if names is None else names[index]
                        name = ".".join(p for p in (layer, path, key) if p)
                        uses.setdefault(id(tensor), []).append((next(number), name, stage, owner, key, kind))
                        if id(tensor) not in spans:
                            spans[id(tensor)] = byte_span(tensor)
    keys = list(uses)  # dicts keep insertion order: tensors by first use
    groups = overlapping([spans[k] for k in keys])  # groups by first use, uses in model order
    return [[use[1:] for use in sorted((u for i in group for u in uses[keys[i]]), key=lambda use: use[0])]
            for group in groups]


def overlapping(spans: Sequence) -> list[list[int]]:
    """Indices of ``spans`` (each :func:`byte_span`'s ``(storage, first byte, end byte)``, or ``None``: alone)
    grouped by memory: spans of one storage whose byte ranges overlap share a group, transitively. Groups in the
    order of their first index, indices ascending."""
    parent = list(range(len(spans)))

    def root(k):
        while parent[k] != k:
            parent[k] = k = parent[parent[k]]
        return k

    by_storage: dict = {}
    for k, span in enumerate(spans):
        if span is not None:
            by_storage.setdefault(span[0], []).append((span[1], span[2], k))
    for spans_of in by_storage.values():
        spans_of.sort()
        end, last = -1, None
        for first, stop, k in spans_of:
            if first < end:  # overlaps the bytes of an earlier tensor of this storage
                parent[root(k)] = root(last)
            if stop > end:
                end, last = stop, k
    groups: dict[int, list] = {}
    for k in range(len(spans)):
        groups.setdefault(root(k), []).append(k)
    return list(groups.values())


def byte_span(tensor) -> tuple | None:
    """``((device, storage address), first byte, end byte)`` of the memory ``tensor`` covers, or ``None`` where it
    has none to share (empty, meta, sparse, or a tensor without an ordinary storage)."""
    try:
        if tensor.numel() == 0 or tensor.device.type == "meta" or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() == 0:
            return None
        size = tensor.element_size()
        first = tensor.storage_offset() * size
        last = first + (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))) * size
        return (str(tensor.device), storage.data_ptr()), first, last
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def checked_on(shared: Sequence[SharedBuffer], pp_rank: int, num_microbatches: int) -> list[SharedBuffer]:
    """The buffers of ``shared`` that :func:`check_unchanged` watches on pipeline rank ``pp_rank``: those used on
    two ranks or more, this one among them; and, when a step has several microbatches, those whose stages are all
    on this rank: the stages share one copy, but the rank runs one stage's microbatches before the next stage's
    (``zbv``'s stages 0 and ``2p - 1``, interleaved stages ``r`` and ``r + p``), so a buffer their forwards change
    and read (an exponential moving average) would see its updates in another order than the unsplit model's. Even
    a buffer whose order does not matter (a counter only ever incremented) is refused when it changes: which
    buffers those are cannot be told from outside."""
    return [b for b in shared if pp_rank in b.ranks and (len(b.ranks) > 1 or num_microbatches > 1)]


def refuse_running_stats(shared: Sequence[SharedBuffer]) -> None:
    """Refuse a norm layer that tracks running statistics (``BatchNorm``, ``InstanceNorm(track_running_stats=True)``)
    used by two stages or more, before any communication: on two ranks each would update only its own copy; on one
    rank its stages run a microbatch's uses in another order than the unsplit model (a rank runs one stage's
    microbatches before the next stage's), and the running averages depend on the order.

    Raises:
        ValueError: names the buffer's names in the unsplit model, the module's class, the stages and ranks.
    """
    for buffer in shared:
        if any(getattr(owner, "track_running_stats", False) is True and key in _RUNNING_STATS
               for owner, key in buffer.members or ((buffer.owner, buffer.key),)):
            why = ("each rank would update only its own copy (buffers are not summed like tied parameters)"
                   if len(buffer.ranks) > 1 else "its stages would update it in another order than the unsplit "
                   "model (a rank runs one stage's microbatches before the next stage's)")
            raise ValueError(f"{describe(buffer)}: {type(buffer.owner).__name__} updates it in every training "
                             f"forward, and {why}, so its running statistics would differ from the unsplit "
                             f"model's; put its uses in one stage (balance=), or give each use its own module")


def describe(buffer: SharedBuffer) -> str:
    if len(buffer.members) > 1:  # different tensors over one memory
        return (f"buffers {' and '.join(repr(n) for n in buffer.names)} share memory (views of one storage) and are "
                f"used by stages {list(buffer.stages)} on pipeline ranks {list(buffer.ranks)}")
    return (f"buffer {' = '.join(repr(n) for n in buffer.names)} is used by stages {list(buffer.stages)} on "
            f"pipeline ranks {list(buffer.ranks)}")


def snapshot(shared: Sequence[SharedBuffer]) -> list:
    """This rank's copies' values now (clones), for :func:`check_unchanged` after the step."""
    with torch.no_grad():
        return [[t.detach().clone() for t in buffer.tensors()] for buffer in shared]


def check_unchanged(shared: Sequence[SharedBuffer], before: Sequence) -> None:
    """Raises:
        RuntimeError: a shared buffer changed during the step on this rank (names it, its stages and ranks); the
            Pipeline then ends every rank with a ``PipelineError`` naming this rank as the origin.
    """
    for buffer, values in zip(shared, before):
        if len(buffer.tensors()) != len(values) or not all(map(_same, buffer.tensors(), values)):
            why = ("the other ranks' copies did not change alike (buffers are not summed like tied parameters)"
                   if len(buffer.ranks) > 1 else "its stages ran their microbatches' uses in another order than "
                   "the unsplit model (this rank runs one stage's microbatches before the next stage's)")
            where = "on one rank" if len(buffer.ranks) > 1 else "in one stage"
            raise RuntimeError(f"{describe(buffer)}, and this rank's forward changed it: {why}, so its values "
                               f"would differ from the unsplit model's; put its uses {where} (balance=), or give "
                               f"each use its own buffer")


def _same(now, before) -> bool:
    """Equal shapes, dtypes and values (a NaN equal to a NaN: a buffer holding one has not changed)."""
    if now is None or now.shape != before.shape or now.dtype != before.dtype:
        return False
    if torch.equal(now, before):  # the common case, and ~6x cheaper than the NaN-aware compare
        return True
    return (now.is_floating_point() or now.is_complex()) and bool(
        torch.allclose(now, before, rtol=0, atol=0, equal_nan=True))
