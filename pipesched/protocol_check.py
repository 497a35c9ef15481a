"""The checks :func:`pipesched.protocol.check_step` runs on every rank's posts of a step (each rank's list of
``(instruction position, Post)`` from the posts of :mod:`pipesched.protocol`): the step opens with its all-gather
(:func:`check_opening`), the replicas' agreement comes right after it with ``dp_size > 1`` and never without
(:func:`check_replicas`), the loss and the norm parts match last on their pairs (:func:`check_loss_last`,
:func:`check_norm_parts_last`), every pair's sends and receives are the same messages in one order
(:func:`check_pairs_match`), and on a backend that runs a pair's messages in issue order both ranks post them in one
order (:func:`check_same_pair_order`); and the view of a program that the learning step's deadlock proof runs
(:func:`learning_view`). Each check raises a :class:`~pipesched.errors.PairingError` naming the rank, the
instruction and the messages, with the program's grid marked there. Torch-free.
"""
from __future__ import annotations

from .errors import DependencyError, PairingError, failure_at, render_grid
from .ir import OVERLAP_PAIRS, Op, Program
from .protocol_messages import LOSS, NORM, OPENING, REPLICAS, describe


def check_gradient_receives_sized(program: Program) -> None:
    """In a step that learns the message shapes, a ``RECV_B`` of (stage, microbatch) is sized by that forward's
    output, known on its rank only once its ``F`` ran: each ``RECV_B`` must come after the ``F`` of its stage and
    microbatch on its rank. (A later step knows every shape beforehand and may post it anywhere.)

    Raises:
        DependencyError: a ``RECV_B`` before its ``F`` (names both, with the grid marked there).
    """
    for rank, stream in enumerate(program.ranks):
        ran = set()
        for pos, instr in enumerate(stream):
            if instr.op is Op.F:
                ran.add((instr.stage, instr.microbatch))
            elif instr.op is Op.RECV_B and (instr.stage, instr.microbatch) not in ran:
                raise failure_at(DependencyError, program, rank, pos,
                                 f"comes before F{instr.stage}.{instr.microbatch}, whose output sizes the gradient "
                                 f"it receives: a step that learns the message shapes (a Pipeline's first step, and "
                                 f"the first after a change of input signature or settings) knows that size only "
                                 f"once the forward ran; post it after F{instr.stage}.{instr.microbatch}")


def learning_view(program: Program) -> Program:
    """``program`` as a step that learns the message shapes runs it, in the checker's model: there a RECV_F
    waits for its shape header, i.e. until its SEND_F is issued. The model's RECV never blocks, so the view
    moves each F whose input comes through a RECV_F of its rank to right after that RECV_F, where it waits
    for the same message: the rank stops at the same places, and an F run earlier only makes its outputs
    available earlier to instructions that come after its old place anyway. So the view completes in the
    checker's model exactly when the learning step does."""
    streams = []
    for stream in program.ranks:
        received = {(i.stage, i.microbatch) for i in stream if i.op is Op.RECV_F}
        forwards = {(i.stage, i.microbatch): i for i in stream if i.op is Op.F}
        out = []
        for instr in stream:
            key = (instr.stage, instr.microbatch)
            if instr.op is Op.F and key in received:
                continue
            out.append(instr)
            if instr.op is Op.RECV_F and key in forwards:
                out.append(forwards[key])
        streams.append(tuple(out))
    view = program.replace(streams)
    view.meta.pop(OVERLAP_PAIRS, None)  # a moved F leaves its overlapped pair; the view is for the deadlock proof only
    return view


def check_opening(program: Program, posts: list) -> None:
    """Every rank's step opens with the all-gather, and has it once: no message posted before it can still be
    unfinished, and none of the step comes after the next step's."""
    for rank, mine in enumerate(posts):
        gathers = [k for k, (_, post) in enumerate(mine) if post.message == OPENING]
        if gathers != [0] or mine[0][1].kind != "all_gather":
            at = mine[gathers[0] if gathers else 0][0] if mine else 0
            raise PairingError(f"rank {rank}'s step must open with the all-gather on the pipeline group, once, before "
                               f"any point-to-point message; it posts it at positions {gathers} of its posts",
                               rank, _instr_at(program, rank, at), render_grid(program.ranks, {rank: at}))


def check_replicas(program: Program, posts: list) -> None:
    """With ``dp_size > 1``, every rank's second post is the replicas' all-gather on the data-parallel group, its
    only one, posted before any instruction of its stream (so before its first message and ``ALL_REDUCE``); with
    one replica, no rank posts it."""
    want = [1] if program.dp_size > 1 else []
    for rank, mine in enumerate(posts):
        stream = program.ranks[rank]
        agreements = [k for k, (_, post) in enumerate(mine) if post.message == REPLICAS]
        reduces = [k for k, instr in enumerate(stream) if instr.op is Op.ALL_REDUCE]
        if agreements == want and all(mine[k][1].kind == "all_gather" and mine[k][0] == 0
                                      and not (reduces and reduces[0] == 0) for k in agreements):
            continue
        at = mine[agreements[0]][0] if agreements else 0
        where = f"it posts it at positions {agreements} of its posts"
        if agreements == want:
            where += (f" (kind {mine[1][1].kind!r}) with instruction {at} of its stream, whose ALL_REDUCEs are "
                      f"at {reduces}")
        must = ("posted once, right after the step's opening, before any message or ALL_REDUCE of its program"
                if want else "absent (one replica)")
        raise PairingError(f"rank {rank}'s replicas' agreement (the all-gather on the data-parallel group, dp_size "
                           f"{program.dp_size}) must be {must}; {where}", rank, _instr_at(program, rank, at),
                           render_grid(program.ranks, {rank: at}))


def check_pairs_match(program: Program, posts: list) -> None:
    """For every ordered pair (a, b): a's sends to b and b's receives from a are the same messages, in order."""
    for a in range(program.num_ranks):
        for b in range(program.num_ranks):
            if a == b:
                continue
            sent = [(at, post) for at, post in posts[a] if post.kind == "send" and post.peer == b]
            received = [(at, post) for at, post in posts[b] if post.kind == "recv" and post.peer == a]
            for k in range(max(len(sent), len(received))):
                ours = sent[k][1] if k < len(sent) else None
                theirs = received[k][1] if k < len(received) else None
                if ours is not None and theirs is not None and ours[2:] == theirs[2:]:
                    continue
                marks = {**({a: sent[k][0]} if ours else {}), **({b: received[k][0]} if theirs else {})}
                rank, at = (a, sent[k][0]) if ours else (b, received[k][0])
                raise PairingError(
                    f"message {k + 1} from rank {a} to rank {b} in a step: rank {a} sends {_carried(ours)}, rank {b} "
                    f"posts the receive of {_carried(theirs)}; first-in first-out matching would give a receive "
                    f"another message, or leave one unfinished when the next step's all-gather starts",
                    rank, _instr_at(program, rank, at), render_grid(program.ranks, marks))


def _carried(post) -> str:
    if post is None:
        return "nothing (no such message in the step)"
    count = "" if post.tensors is None else f" ({post.tensors} tensors)"
    return describe(post.message) + count


def _instr_at(program: Program, rank: int, at: int):
    stream = program.ranks[rank]
    return stream[at] if stream else None


def check_norm_parts_last(program: Program, posts: list) -> None:
    """Each rank sends each other rank one norm part, as its last send to it, and posts one part receive per
    peer, as its last receive from it: first-in first-out matching gives each part its receive."""
    for rank, mine in enumerate(posts):
        for peer in range(program.num_ranks):
            if peer == rank:
                continue
            for kind in ("send", "recv"):
                ours = [(at, post) for at, post in mine if post.peer == peer and post.kind == kind]
                parts = [k for k, (_, post) in enumerate(ours) if post.message == NORM]
                if parts != [len(ours) - 1]:
                    at = ours[parts[0] if parts else -1][0] if ours else 0
                    side = f"sends rank {peer}" if kind == "send" else f"receives from rank {peer}"
                    raise PairingError(f"rank {rank}'s norm part {'to' if kind == 'send' else 'from'} rank {peer} "
                                       f"must be the last message it {side}, once; it is at positions {parts} of "
                                       f"its {len(ours)} such messages", rank, _instr_at(program, rank, at),
                                       render_grid(program.ranks, {rank: at}))


def check_loss_last(program: Program, posts: list) -> None:
    """On each rank, the receive of the step's loss is its last receive from the last stage's rank (the norm parts
    aside, which come after it): first-in first-out matching gives it its message."""
    last = program.stage_to_rank[-1]
    for rank, mine in enumerate(posts):
        mine = [(at, post) for at, post in mine if post.message != NORM]  # the parts come after the loss
        received = [(at, post) for at, post in mine if post.peer == last and post.kind == "recv"]
        messages = {post.message for _, post in received}
        if LOSS in messages and received[-1][1].message != LOSS:
            at = received[-1][0]
            raise PairingError(f"the receive of the step's loss is posted before this receive from rank {last}, "
                               f"so first-in first-out matching would give it another message", rank,
                               program.ranks[rank][at], render_grid(program.ranks, {rank: at}))


def check_same_pair_order(program: Program, posts: list) -> None:
    """Between every two ranks, both post their messages of both directions in one order (NCCL)."""
    for a in range(program.num_ranks):
        for b in range(a + 1, program.num_ranks):
            mine = [(at, post) for at, post in posts[a] if post.peer == b]
            theirs = [(at, post) for at, post in posts[b] if post.peer == a]
            for (at_a, ours), (at_b, peer) in zip(mine, theirs):
                if ours.message != peer.message or ours.kind == peer.kind:
                    raise PairingError(
                        f"ranks {a} and {b} post their messages to each other in different orders: here rank {a} "
                        f"posts the {ours.kind} of {describe(ours.message)}, where rank {b} posts the "
                        f"{peer.kind} of {describe(peer.message)}; a backend that runs a pair's messages in "
                        f"issue order on one stream (NCCL) would hang", a, program.ranks[a][at_a],
                        render_grid(program.ranks, {a: at_a, b: at_b}))
