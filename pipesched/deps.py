"""The dataflow rules, written once: what each instruction consumes and produces.

Every other module (lowering, validation, simulation, drawing) asks these two functions and nothing
else which instruction waits on which. Data items are small tuples:

- ``("act", s, mb)``: the output of stage ``s`` (the input of stage ``s + 1``).
- ``("grad", s, mb)``: the gradient of the input of stage ``s`` (the output gradient of stage ``s - 1``).
- ``("fwd", s, mb)``: stage ``s`` holds what its backward needs (after ``F``, or ``R`` when recomputed).
- ``("igrad", s, mb)``: the input-gradient half of a split backward is done (``W`` may run).
- ``("wgrad", s, mb)``: the weight gradient of (s, mb) is accumulated (``ALL_REDUCE`` waits for all of them).

The rules: F(s) needs act(s-1); B/I(s) need fwd(s) and grad(s+1); W needs igrad; R needs F's
stage input (modelled as the ``F`` having run); ALL_REDUCE(s) needs every wgrad(s, ·).

Fast passes over large programs use :class:`RuleTable`: the same rules, read off :func:`needs` and
:func:`produces` once per (kind, stage), with every item numbered by an integer.
"""
from __future__ import annotations

from .ir import Instr, Op

Item = tuple  # ("act" | "grad" | "fwd" | "rec" | "igrad" | "wgrad", stage, microbatch)

KINDS = ("act", "grad", "fwd", "rec", "igrad", "wgrad")  # every item kind, in the order RuleTable numbers them
REMOTE_KINDS = ("act", "grad")  # the only items that can cross ranks (through SEND/RECV)


def needs(instr: Instr, num_stages: int, num_microbatches: int, recomputed: bool = False) -> tuple[Item, ...]:
    """The data items ``instr`` consumes. ``recomputed``: (stage, mb) has an ``R`` in the program."""
    op, s, mb = instr.op, instr.stage, instr.microbatch
    if op is Op.F:
        return (("act", s - 1, mb),) if s > 0 else ()
    if op in (Op.B, Op.I):
        state = ("rec", s, mb) if recomputed else ("fwd", s, mb)
        return (state, ("grad", s + 1, mb)) if s < num_stages - 1 else (state,)
    if op is Op.W:
        return (("igrad", s, mb),)
    if op is Op.R:
        return (("fwd", s, mb),)
    if op is Op.SEND_F:
        return (("act", s, mb),)
    if op is Op.SEND_B:
        return (("grad", s, mb),)
    if op is Op.ALL_REDUCE:
        return tuple(("wgrad", s, m) for m in range(num_microbatches))
    return ()  # RECV_F, RECV_B need nothing local


def produces(instr: Instr, split_backward: bool = False) -> tuple[Item, ...]:
    """The data items ``instr`` makes available on its rank.

    ``split_backward``: (stage, mb) uses I + W instead of B (then ``I`` does not produce ``wgrad``).
    """
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
    if op is Op.RECV_F:
        return (("act", s - 1, mb),)
    if op is Op.RECV_B:
        return (("grad", s + 1, mb),)
    return ()


def comm_for(item: Item) -> tuple[Op, int, Op, int] | None:
    """For a cross-rank item: (send op, its stage, recv op, its stage); ``None`` if never sent."""
    kind, s, _ = item
    if kind == "act":
        return (Op.SEND_F, s, Op.RECV_F, s + 1)
    if kind == "grad":
        return (Op.SEND_B, s, Op.RECV_B, s - 1)
    return None


def message(instr: Instr) -> Item:
    """The item a SEND or RECV carries — the same for a SEND and its matching RECV."""
    if instr.op in (Op.SEND_F, Op.SEND_B):
        return needs(instr, 0, 0)[0]  # what a SEND needs does not depend on the sizes
    return produces(instr)[0]


def neighbour_stage(op: Op, stage: int) -> int:
    """The stage at the other end of a SEND/RECV of ``op`` at ``stage`` (may be out of range)."""
    return stage + 1 if op in (Op.SEND_F, Op.RECV_B) else stage - 1


def consumer_stage(item: Item) -> int:
    """The stage whose compute consumes a communicated item."""
    kind, s, _ = item
    return s + 1 if kind == "act" else s - 1


class RuleTable:
    """:func:`needs` and :func:`produces` for one program's sizes, as integers, for passes over large programs.

    Item ``(kind, s, mb)`` is numbered ``item_id(kind, s, mb)``; stages -1 and ``S`` (the items an ill-formed
    instruction at the pipeline's ends would name) get numbers of their own, so ids never collide.
    Every instruction ``(op, s, mb)`` maps to a *rule* ``rule(op, s, recomputed)``, an index into tuples of
    per-rule facts; an item id is a rule's base plus the microbatch (``ALL_REDUCE`` bases are complete ids).

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
        #: ``by_op[op][s]``: the rule of ``op`` at stage ``s``, not recomputed (made for an op on first use)
        self.by_op = _RulesByOp(self)

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
            probe = Instr(op, stage) if op is Op.ALL_REDUCE else Instr(op, stage, 0, 0 if _is_comm(op) else None)
            self.op.append(op)
            self.stage.append(stage)
            self.need.append(tuple(self.item_id(*it) for it in needs(probe, self.S, self.M, recomputed)))
            self.made.append(tuple(self.item_id(*it) for it in produces(probe)))
        return index


class _RulesByOp(dict):
    """op -> [the rule of op at each stage], filled in on first use."""

    def __init__(self, table: RuleTable) -> None:
        super().__init__()
        self.table = table

    def __missing__(self, op: Op) -> list[int]:
        rules = self[op] = [self.table.rule(op, s) for s in range(self.table.S)]
        return rules


def _is_comm(op: Op) -> bool:
    return op in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
