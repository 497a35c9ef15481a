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
"""
from __future__ import annotations

from .ir import Instr, Op

Item = tuple  # ("act" | "grad" | "fwd" | "igrad" | "wgrad" | "ran", stage, microbatch)


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


def consumer_stage(item: Item) -> int:
    """The stage whose compute consumes a communicated item."""
    kind, s, _ = item
    return s + 1 if kind == "act" else s - 1
