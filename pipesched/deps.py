"""The dataflow rules, written once: what each instruction consumes and produces.

Every other module (lowering, validation, simulation, memory, drawing) asks this module and nothing else
which instruction waits on which, which message a SEND or RECV carries and what holds activations.
Data items are small tuples:

- ``("act", s, mb)``: the output of stage ``s`` (the input of stage ``s + 1``).
- ``("grad", s, mb)``: the gradient of the input of stage ``s`` (the output gradient of stage ``s - 1``).
- ``("fwd", s, mb)``: stage ``s`` holds what its backward needs (after ``F``).
- ``("rec", s, mb)``: the recompute ``R`` of (s, mb) ran (a recomputed stage's backward needs it, not ``fwd``).
- ``("igrad", s, mb)``: the input-gradient half of a split backward is done (``W`` may run).
- ``("wgrad", s, mb)``: the weight gradient of (s, mb) is accumulated (``ALL_REDUCE`` and ``TIE_REDUCE`` wait
  for all of them).

The rules: F(s) needs act(s-1); B/I(s) need fwd(s) (rec(s) when (s, mb) is recomputed) and grad(s+1);
W needs igrad; R needs F's stage input (modelled as the ``F`` having run); ALL_REDUCE(s) and TIE_REDUCE(s) need
every wgrad(s, ·) (that TIE_REDUCE(s) also comes after the other tied stages' is :mod:`pipesched.ties`'s check). Only act and grad cross ranks, and :data:`STEP` is the one neighbour rule: item
(kind, s, mb) is consumed by stage ``s + STEP[kind]``. A SEND carries an item of its own stage, the matching
RECV posts for it at the consumer's stage (:func:`message`, :func:`route`). Memory: ``F`` stashes what the
backward of (s, mb) needs, the instruction that ends that backward (``B``, or ``W`` of a split) frees it
(:data:`STASH_CHANGE`).

Fast passes over large programs use :class:`RuleTable`: the same rules, read off :func:`needs` and
:func:`produces` once per (kind, stage), with every item numbered by an integer.
"""
from __future__ import annotations

from typing import NamedTuple

from .ir import BACKWARD_OPS, COLLECTIVE_OPS, COMM_OPS, RECV_OPS, SEND_OPS, Instr, Op

Item = tuple  # ("act" | "grad" | "fwd" | "rec" | "igrad" | "wgrad", stage, microbatch)

KINDS = ("act", "grad", "fwd", "rec", "igrad", "wgrad")  # every item kind, in the order RuleTable numbers them
#: the items that cross ranks and which way they go: (kind, s, mb) is consumed by stage s + STEP[kind] — a
#: stage's output feeds the next stage, the gradient of its input goes back to the previous one
STEP = {"act": 1, "grad": -1}
REMOTE_KINDS = tuple(STEP)  # the only items that can cross ranks (through SEND/RECV)
#: per item kind that crosses ranks, the SEND and the RECV that carry it
_CARRIERS = {"act": (Op.SEND_F, Op.RECV_F), "grad": (Op.SEND_B, Op.RECV_B)}
_CARRIED = {op: kind for kind, ops in _CARRIERS.items() for op in ops}  # SEND/RECV op -> the kind it carries
#: the kinds that end the backward of (s, mb): they make its weight gradient (``B``, or ``W`` of a split backward)
ENDS_BACKWARD = frozenset({Op.B, Op.W})
#: how each kind changes the microbatch-stages whose activations its rank holds for backward (in flight):
#: ``F`` stashes them, the instruction that ends the backward frees them
STASH_CHANGE = {op: 1 if op is Op.F else -1 if op in ENDS_BACKWARD else 0 for op in Op}


def needs(instr: Instr, num_stages: int, num_microbatches: int, recomputed: bool = False) -> tuple[Item, ...]:
    """The data items ``instr`` consumes. ``recomputed``: (stage, mb) has an ``R`` in the program."""
    op, s, mb = instr.op, instr.stage, instr.microbatch
    if op is Op.F:
        return _from_neighbour("act", s, mb, num_stages)
    if op in BACKWARD_OPS:
        state = ("rec", s, mb) if recomputed else ("fwd", s, mb)
        return (state,) + _from_neighbour("grad", s, mb, num_stages)
    if op is Op.W:
        return (("igrad", s, mb),)
    if op is Op.R:
        return (("fwd", s, mb),)
    if op in SEND_OPS:
        return (message(instr),)
    if op in COLLECTIVE_OPS:
        return tuple(("wgrad", s, m) for m in range(num_microbatches))
    return ()  # RECV_F, RECV_B need nothing local


def _from_neighbour(kind: str, stage: int, mb: int, num_stages: int) -> tuple[Item, ...]:
    """The item of ``kind`` that ``stage`` consumes from its neighbour stage, if that stage exists."""
    source = stage - STEP[kind]
    return ((kind, source, mb),) if 0 <= source < num_stages else ()


def produces(instr: Instr) -> tuple[Item, ...]:
    """The data items ``instr`` makes available on its rank."""
    op, s, mb = instr.op, instr.stage, instr.microbatch
    if op is Op.F:
        return (("act", s, mb), ("fwd", s, mb))
    if op is Op.B:
        return (("grad", s, mb), ("wgrad", s, mb))
    if op is Op.I:
        return (("grad", s, mb), ("igrad", s, mb))
    if op is Op.W:
        return (("wgrad", s, mb),)
    if op is Op.R:
        return (("rec", s, mb),)
    if op in RECV_OPS:
        return (message(instr),)
    return ()


def message(instr: Instr) -> Item:
    """The item a SEND or RECV carries — the same for a SEND and its matching RECV: a SEND sends an item of
    its own stage, a RECV posts for the item its own stage consumes."""
    kind = _CARRIED[instr.op]
    stage = instr.stage if instr.op in SEND_OPS else instr.stage - STEP[kind]
    return (kind, stage, instr.microbatch)


class Route(NamedTuple):
    """How an item that crosses ranks travels: ``send`` at ``send_stage`` (its producer's stage), ``recv`` at
    ``recv_stage`` (the stage that consumes it; out of range for an item no stage consumes)."""

    send: Op
    send_stage: int
    recv: Op
    recv_stage: int


def route(item: Item) -> Route | None:
    """The SEND and RECV that carry ``item`` (see :class:`Route`); ``None`` for an item that never crosses ranks."""
    kind, s, _ = item
    if kind not in _CARRIERS:
        return None
    send, recv = _CARRIERS[kind]
    return Route(send, s, recv, s + STEP[kind])


def describe(item: Item) -> str:
    """``item`` in words, for error messages: ``("act", 1, 0)`` is "the output of stage 1 for microbatch 0"."""
    kind, s, mb = item
    return {
        "act": f"the output of stage {s} for microbatch {mb}",
        "grad": f"the input gradient of stage {s} for microbatch {mb}",
        "fwd": f"the forward F{s}.{mb}",
        "rec": f"the recompute R{s}.{mb}",
        "igrad": f"the input-gradient backward I{s}.{mb}",
        "wgrad": f"the weight gradient of stage {s}, microbatch {mb}",
    }[kind]


def boundary(item: Item) -> int:
    """The stage whose output shapes a crossing item's tensor (so its size is that stage's activation bytes):
    the lower of its producer's and its consumer's stage (act(s): stage s's output; grad(s), the gradient of
    stage s's input: stage s - 1's output)."""
    kind, s, _ = item
    return min(s, s + STEP[kind])


class RuleTable:
    """:func:`needs` and :func:`produces` for one program's sizes, as integers, for passes over large programs.

    Item ``(kind, s, mb)`` is numbered ``item_id(kind, s, mb)``; stages -1 and ``S`` (the items an ill-formed
    instruction at the pipeline's ends would name) get numbers of their own, so ids never collide.
    Every instruction ``(op, s, mb)`` maps to a *rule* ``rule(op, s, recomputed)``, an index into tuples of
    per-rule facts; an item id is a rule's base plus the microbatch (``ALL_REDUCE``/``TIE_REDUCE`` bases are complete
    ids).

    Attributes, indexed by rule:
        op, stage: what the rule is for.
        need: base ids of the items consumed (``needs``).
        made: base ids of the items produced (``produces``).
    """

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        self.S, self.M = num_stages, num_microbatches
        self.num_items = len(KINDS) * (num_stages + 2) * num_microbatches
        self.op: list[Op] = []
        self.stage: list[int] = []
        self.need: list[tuple[int, ...]] = []
        self.made: list[tuple[int, ...]] = []
        self._index: dict[tuple[Op, int, bool], int] = {}

    def item_id(self, kind: str, stage: int, microbatch: int) -> int:
        """The number of item ``(kind, stage, microbatch)``."""
        return (KINDS.index(kind) * (self.S + 2) + stage + 1) * self.M + microbatch

    def item(self, item_id: int) -> Item:
        """The item numbered ``item_id`` (the inverse of :meth:`item_id`)."""
        rest, mb = divmod(item_id, self.M)
        kind, stage = divmod(rest, self.S + 2)
        return (KINDS[kind], stage - 1, mb)

    def rule(self, op: Op, stage: int, recomputed: bool = False) -> int:
        """The rule of ``op`` at ``stage`` (``recomputed``: its (stage, mb) has an R), made on first use."""
        key = (op, stage, recomputed)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.op)
            probe = Instr(op, stage) if op in COLLECTIVE_OPS else Instr(op, stage, 0, 0 if op in COMM_OPS else None)
            self.op.append(op)
            self.stage.append(stage)
            self.need.append(tuple(self.item_id(*it) for it in needs(probe, self.S, self.M, recomputed)))
            self.made.append(tuple(self.item_id(*it) for it in produces(probe)))
        return index
