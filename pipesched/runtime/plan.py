"""What one rank's executor runs, in which order: receives posted early, where the loss receive goes, which
parameters each ALL_REDUCE averages. Decided once per program, before any step."""
from __future__ import annotations

from ..ir import RECV_OPS, SEND_OPS, Op

FORWARD_OPS = (Op.F, Op.SEND_F, Op.RECV_F)
RECV_AHEAD = 16  # stream positions a receive is posted ahead of where the program places it


def hoist_recvs(stream, ahead: int) -> list:
    """The stream with every RECV moved up to ``ahead`` positions earlier (receives in the same relative
    order). Posting a receive early never blocks and the peer's sends are unchanged, so the validator's
    deadlock-freedom still holds; the transfer then overlaps this rank's compute. Costs at most ``ahead``
    positions' worth of receive buffers allocated early."""
    keyed = [((pos - ahead if instr.op in RECV_OPS else pos), 0 if instr.op in RECV_OPS else 1, pos, instr)
             for pos, instr in enumerate(stream)]
    hoisted = [item[3] for item in sorted(keyed)]
    # within a run of communication, sends first: a send is on a peer's critical path, a post is not
    out, run = [], []
    for instr in hoisted + [None]:
        if instr is not None and (instr.op in RECV_OPS or instr.op in SEND_OPS):
            run.append(instr)
            continue
        out.extend([i for i in run if i.op in SEND_OPS] + [i for i in run if i.op in RECV_OPS])
        run = []
        if instr is not None:
            out.append(instr)
    return out


def run_orders(stream, hoist: bool) -> dict:
    """``{(train, early): instructions in run order}``: training runs the whole stream, ``forward()`` only its
    forward instructions; ``early`` orders post receives ahead (:func:`hoist_recvs`), and exist only when
    ``hoist`` (the backend matches messages by tag)."""
    forward = [i for i in stream if i.op in FORWARD_OPS]
    return {(train, early): (hoist_recvs(st, RECV_AHEAD) if early else list(st))
            for train, st in ((True, stream), (False, forward)) for early in (False, hoist)}


def loss_post_position(order, last_rank: int, early: bool) -> int:
    """Where, in ``order``, a rank without the last stage posts the receive of the step's loss, the last
    message the last stage's rank sends it (-1: before everything).

    ``early`` (gloo, which matches by tag): right after its last receive from that rank, so the loss is
    there when the stream ends. Otherwise (NCCL, which matches by order, and where a posted receive holds up
    every later send to that rank on the pair's stream): after the last instruction, so nothing this rank
    still sends waits behind it.
    """
    if not early:
        return len(order) - 1
    return max([k for k, i in enumerate(order) if i.op in RECV_OPS and i.peer == last_rank], default=-1)


def reduced_params(params: dict, stream) -> dict:
    """{stage: the parameters its ALL_REDUCE averages}: a parameter shared by two of this rank's stages is
    averaged once, by the later of their ALL_REDUCEs, when both stages' gradients are in."""
    order = {i.stage: k for k, i in enumerate(stream) if i.op is Op.ALL_REDUCE}
    last: dict = {}  # id(param) -> the stage whose ALL_REDUCE comes last
    for s, ps in params.items():
        for p in ps:
            if order.get(s, -1) >= order.get(last.get(id(p), s), -1):
                last[id(p)] = s
    return {s: [p for p in ps if last[id(p)] == s] for s, ps in params.items()}


def stages_with(program, op: Op) -> frozenset:
    """The stages that have an instruction of kind ``op`` anywhere in ``program`` (``R``: the recomputed
    ones; ``I``: those with a split backward)."""
    return frozenset(i.stage for stream in program.ranks for i in stream if i.op is op)
