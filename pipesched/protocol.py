"""The wire protocol of one pipeline step: every message a rank puts on the wire, in order.

A step of ``pipesched.runtime.Pipeline`` runs one proven program (:class:`pipesched.api.StepPrograms`) and,
on each rank, posts exactly these messages, in this order (:func:`step_posts`):

0. *The step's opening* (``pipesched.runtime.handshake``): one collective all-gather over the pipeline
   group (every rank's settings and anticipated clipping, stage 0's rank's description of the input and, in a
   training step, the last stage's rank's verdict on the target, checked on its own before the gather;
   :data:`OPENING`), which every rank calls before anything else of the step, and only once every message it
   posted in the previous step has been waited for (the executor waits for every send and all-reduce at the
   end of its stream, every receive at the instruction that needs it). It is the step's only message on the
   pipeline group before its program: every rank rules on the gathered rows alike (a refused input or target is
   the same error on every rank), so no point-to-point message opens the step.
1. *The replicas' agreement* (``dp_size > 1`` only; ``Handshake.signature`` -> ``_agree_replicas``): right
   after the opening, whether or not it refused the step, every rank joins one all-gather over its
   data-parallel group (the replicas of its pipeline rank: the call each made, whether it refused and its batch
   size, which weighs its loss in backward;
   :data:`REPLICAS`), so a step one replica refuses is refused on all. It is the step's first collective on
   that group; the only others are the program's ``ALL_REDUCE`` instructions, later. None with one replica.
2. *Program messages*, one per SEND or RECV instruction, at the instruction's place in the rank's stream.
   While a step learns the message shapes (:attr:`Post.message` kind ``"act_header"``), a SEND_F sends a
   shape header right before the activation, and a RECV_F posts the header's receive, waits for it, then
   posts the activation's receive: a header and its payload are consecutive on their pair, in the same
   order on both sides. A gradient message (SEND_B/RECV_B) is *masked* (``runtime/transport.py``): only the
   input tensors of a stage that require grad get one, and some of those may get none (the next stage
   detaches them or never uses them; a stage whose outputs get none skips its backward). While learning,
   the message carries a gradient for each tensor that requires grad (zeros for none) plus a presence mask
   (with each gradient's dim order, one ``uint8`` tensor);
   afterwards only the present gradients; and no message at all where no input tensor requires grad, or
   (known) none gets a gradient. :func:`step_posts` takes which gradients come (``gradients``) and gives
   each gradient message's tensor count (:attr:`Post.tensors`, :func:`gradient_tensors`).
3. *The loss* (training steps): after its last instruction, the rank of the last stage sends the step's
   loss to every other rank, in rank order — its last message to each in the step. Rank ``r`` posts that
   receive at :func:`loss_post_position`: right after its last receive from that rank when the program
   posts receives early (a backend that matches by tag, gloo), else after its last instruction (NCCL, where
   a posted receive holds up the pair's later messages).
4. *The norm parts* (a training step that anticipates a ``clip_grad_norm_``, ``norm_parts``;
   ``runtime/norm_parts.py``): after its last instruction, once its gradients are final (its data-parallel
   all-reduces and tied-gradient sums waited for; where receives are posted early, a rank that owns no tied copy
   sends before waiting for the tied sums), every rank sends its part of the gradient norm to every
   other pipeline rank, in rank order — its last message to each in the step — and receives each other rank's
   part. Rank ``r`` posts the receive of rank ``q``'s part at :func:`norm_post_position`: right after its last
   receive from ``q`` (the loss counted) when the program posts receives early, else at its step's end, where
   each pair posts in one order: the lower rank sends, then receives; the higher rank receives, then sends
   (:func:`norm_end_posts`). Every rank posts all its sends before it waits for any part.

Why this order cannot hang or swap a message (:func:`check_step` checks each point for every program the
runtime runs): every rank reaches the all-gather (it waits for no message of the step first) and joins it once,
before any other message of the step; every rank rules on the same rows, so all go on to the program or none.
With replicas, each rank then joins its data-parallel group's agreement once, before any message or all-reduce
of its program: the replicas of a pipeline rank rule on the same rows too, so all go on or none, and the
group's collectives (the agreement, then the program's ALL_REDUCEs in one order) are called alike on every member.
The program is proven (:mod:`pipesched.validate`) under first-in first-out matching per pair of ranks
whatever the message's kind, and a learning step's program also with each RECV_F blocking until its SEND_F
is issued (:func:`learning_view`). A header and its payload travel together, in one order on both sides.
The loss is the last message from the last stage's rank to each rank, and each rank posts its receive after
every other receive from that rank, so it matches last; the sender sends it once its own stream is done, and
the receive is posted without waiting for anything, so the sends find it. For every ordered pair of ranks,
the messages one sends the other in a step are exactly, in order and in tensor count, those the other posts
receives for in that step: so first-in first-out matching gives every receive its own message, and no
message of a step is left unmatched when a rank, having waited for all of its own, enters the next step's
all-gather (on NCCL the collective runs on the pair's stream behind any unfinished point-to-point message,
which would hang it). A norm part is the last message each way on each pair (after the loss), so it matches last; each rank
sends its parts without waiting for any message first, so every part arrives. A masked gradient drops a message from both sides of its pair alike (both learned the
mask from the one learning message) and only removes a wait, so it keeps every point above; :func:`check_step`
takes the masks too. On a backend that runs a pair's messages in issue order (NCCL), both ranks of each pair
post them in one order.

This module holds the posts (:func:`step_posts`) and the proof's entry (:func:`check_step`); the words they share
(:class:`Post`, :data:`OPENING`, :data:`REPLICAS`, :data:`LOSS`, :data:`NORM`) are in
:mod:`pipesched.protocol_messages` and the checks :func:`check_step` runs (and :func:`learning_view`) in
:mod:`pipesched.protocol_check`; all are importable from here too.
"""
from __future__ import annotations

from .errors import DeadlockError
from .ir import RECV_OPS, SEND_OPS, Op, Program
from .protocol_check import (check_gradient_receives_sized, check_loss_last, check_norm_parts_last, check_opening,
                             check_pairs_match, check_replicas, check_same_pair_order, learning_view)
from .protocol_messages import LOSS, NORM, OPENING, REPLICAS, Post
from .validate import validate


#: Which gradients of one stage input come back when a step's ``gradients`` does not say: one tensor that
#: requires grad and gets a gradient (a stage of a plain ``nn.Sequential`` of ``Linear`` layers).
ALL_GRADIENTS = (True,)


def gradient_tensors(mask: tuple, learning: bool) -> int:
    """How many tensors the gradient message of one stage input carries (0: no message is posted).

    Args:
        mask: one bool per tensor of the stage's input that requires grad, True where it gets a gradient
            (``()``: no input tensor requires grad).
        learning: the step learns the message metas: the message then carries every gradient of ``mask``
            (zeros for the absent ones) plus one ``uint8`` tensor, the presence mask and each gradient's dim
            order; afterwards only the present ones.
    """
    if learning:
        return len(mask) + 1 if mask else 0
    return sum(1 for bit in mask if bit)


def loss_post_position(stream, last_rank: int, early: bool) -> int:
    """Where, in ``stream``, a rank without the last stage posts the receive of the step's loss, the last
    message the last stage's rank sends it: after the instruction at the returned position (-1: before
    everything).

    ``early`` (the program posts receives early; gloo, which matches by tag): right after its last receive
    from that rank, so the loss is there when the stream ends. Otherwise (NCCL, which matches by order, and
    where a posted receive holds up every later send to that rank on the pair's stream): after the last
    instruction, so nothing this rank still sends waits behind it.
    """
    return last_receive_from(stream, last_rank) if early else len(stream) - 1


def last_receive_from(stream, peer: int) -> int:
    """The position in ``stream`` of its last receive from ``peer`` (-1: none): where, receives being posted early,
    a rank posts the receive of a message ``peer`` sends after its stream (the loss, a norm part)."""
    return max([k for k, i in enumerate(stream) if i.op in RECV_OPS and i.peer == peer], default=-1)


def norm_post_position(stream, peer: int, early: bool) -> int | None:
    """Where, in ``stream``, a rank posts the receive of ``peer``'s norm part (a step with ``norm_parts``): after
    the instruction at the returned position (-1: before everything; the same position as the loss receive
    comes after it), or ``None``: at the step's end, in :func:`norm_end_posts`' order.

    ``early`` (gloo): right after its last receive from ``peer`` (the loss receive is there too, when ``peer``
    is the last stage's rank), so the part finds its receive posted when ``peer`` finishes first: one message
    hop, not a round trip, between ``peer``'s end and this rank knowing its part. Otherwise (NCCL): at the end.
    """
    return last_receive_from(stream, peer) if early else None


def norm_end_posts(rank: int, num_ranks: int, early: bool) -> list[tuple[str, int]]:
    """The norm-part posts ``rank`` makes at its step's end, in order: ``("send" | "recv", peer)``. Early
    (receives already posted): a send to every other rank, in rank order. Otherwise, per peer in rank order,
    the lower rank of the pair sends then receives, the higher receives then sends: one order per pair."""
    posts = []
    for peer in range(num_ranks):
        if peer == rank:
            continue
        if early:
            posts.append(("send", peer))
        else:
            pair = [("send", peer), ("recv", peer)]
            posts += pair if rank < peer else pair[::-1]
    return posts


def instruction_posts(instr, learning: bool, gradients=None) -> list[Post]:
    """The posts one SEND or RECV instruction makes (none for any other kind); ``learning``: the step learns
    the message shapes (headers before activations, gradient masks); ``gradients``: as :func:`step_posts`."""
    if instr.op not in SEND_OPS and instr.op not in RECV_OPS:
        return []
    kind = "send" if instr.op in SEND_OPS else "recv"
    if instr.op in (Op.SEND_B, Op.RECV_B):
        stage = instr.stage if instr.op is Op.SEND_B else instr.stage + 1  # the gradient of that stage's input
        mask = (gradients or {}).get((stage, instr.microbatch), ALL_GRADIENTS)
        count = gradient_tensors(mask, learning)
        return [Post(kind, instr.peer, ("grad", stage, instr.microbatch), count)] if count else []
    stage = instr.stage if instr.op is Op.SEND_F else instr.stage - 1  # the output of that stage
    header = [Post(kind, instr.peer, ("act_header", stage, instr.microbatch))] if learning else []
    return header + [Post(kind, instr.peer, ("act", stage, instr.microbatch))]


def step_posts(program: Program, rank: int, learning: bool, early: bool, gradients=None,
               norm_parts: bool = False) -> list[Post]:
    """Every message ``rank`` posts in a step that runs ``program`` (see the module docstring), in order: the
    opening all-gather (``Post("all_gather", None, OPENING)``), with ``program.dp_size > 1`` the replicas'
    agreement (``Post("all_gather", None, REPLICAS)``, on the data-parallel group), then each point-to-point
    send and receive.

    Args:
        program: the step's program (forward-only for a ``forward()``: no loss is sent).
        learning: the step learns the message shapes.
        early: the program posts receives early (where the loss receive goes, :func:`loss_post_position`).
        gradients: which gradients come back: ``{(stage, microbatch): mask}``, ``mask`` one bool per tensor of
            that stage's input that requires grad, True where it gets a gradient (what the step learns;
            :func:`gradient_tensors`). A missing pair (or ``None``): :data:`ALL_GRADIENTS`.
        norm_parts: the step anticipates a ``clip_grad_norm_`` (a training step only): each rank's norm part
            to every other rank (:data:`NORM`, :func:`norm_post_position`, :func:`norm_end_posts`).
    """
    return [post for _, post in _numbered_posts(program, rank, learning, early, gradients, norm_parts)]


def _numbered_posts(program: Program, rank: int, learning: bool, early: bool,
                    gradients=None, norm_parts: bool = False) -> list[tuple[int, Post]]:
    """:func:`step_posts`, each with the position of the instruction it belongs to (the loss: the position
    its receive follows, clamped to 0, or the last instruction for its sends; the opening and the replicas'
    agreement: 0; the norm parts: as the loss)."""
    stream, last = program.ranks[rank], program.stage_to_rank[-1]
    train = not program.forward_only
    parts = train and norm_parts
    loss_at = loss_post_position(stream, last, early) if train and rank != last else None
    peers = [q for q in range(program.num_ranks) if q != rank]
    norm_at = {q: norm_post_position(stream, q, early) for q in peers} if parts else {}
    posts = [(0, Post("all_gather", None, OPENING))]  # the verdict on the target travels in it
    if program.dp_size > 1:  # the replicas agree on the step (handshake), whatever the pipeline group ruled
        posts.append((0, Post("all_gather", None, REPLICAS)))
    if loss_at == -1:
        posts.append((0, Post("recv", last, LOSS)))
    posts += [(0, Post("recv", q, NORM)) for q in peers if norm_at.get(q) == -1]
    for at, instr in enumerate(stream):
        posts += [(at, post) for post in instruction_posts(instr, learning, gradients)]
        if at == loss_at:
            posts.append((at, Post("recv", last, LOSS)))
        posts += [(at, Post("recv", q, NORM)) for q in peers if norm_at.get(q) == at]
    end = max(len(stream) - 1, 0)
    if train and rank == last:
        posts += [(end, Post("send", peer, LOSS)) for peer in peers]
    if parts:
        posts += [(end, Post(kind, peer, NORM)) for kind, peer in norm_end_posts(rank, program.num_ranks, early)]
    return posts


def check_step(program: Program, learning: bool, early: bool, same_pair_order: bool = False,
               gradients=None, norm_parts: bool | None = None) -> Program:
    """Prove, for a step that runs ``program`` (validated by :func:`~pipesched.validate.validate`), what the
    checker's model of the program alone leaves out; return ``program``.

    - ``learning``: the step completes although each RECV_F blocks until its SEND_F is issued (the shape
      header's wait): ``validate(learning_view(program))``; and each RECV_B follows its own rank's F of that
      stage and microbatch, whose output sizes it (:func:`check_gradient_receives_sized`).
    - The loss (training programs): on each rank, the loss's receive is its last receive from the last stage's
      rank, so first-in first-out matching gives it its message (the last that rank sends it). Nothing in the
      program waits for the loss and its sends follow the sender's last instruction, so a complete execution
      of the program plus the loss receives (which never block) ends with every loss send finding its receive
      posted. (The verdict on the target is no message: it travels in the opening all-gather.)
    - Every message on the wire is paired within the step: every rank's posts open with the step's all-gather
      (once), and for every ordered pair of ranks (a, b), the messages a sends b are, in order and in tensor
      count, exactly those b posts receives from a (headers, activations, masked gradients, loss, norm parts).
      So first-in first-out matching per pair (NCCL's; gloo's per tag) gives every receive its own message,
      and when a rank enters the next step's all-gather, having waited for all its own posts, no
      point-to-point message of any pair is unfinished (on NCCL the collective would queue behind one: a hang).
    - The replicas' agreement: with ``dp_size > 1`` every rank posts it once, right after the opening and before
      any message of its program and any ``ALL_REDUCE`` (the data-parallel group's other collectives); with one
      replica, never. So every member of a data-parallel group calls the group's collectives in one order.
    - ``same_pair_order`` (a backend that runs the messages between two ranks in issue order on one stream,
      NCCL): between every two ranks, both post their messages of both directions (:func:`step_posts`) in
      one order. With the program proven, each pair's messages then complete in that order.

    Args:
        early: the program posts receives early (where the loss receive goes).
        gradients: which gradients come back (as :func:`step_posts`; ``None``: every one). A mask drops a
            message from both sides of its pair, so the proof with ``None`` covers every mask; pass one to
            check that too.
        norm_parts: check the step with the norm parts of an anticipated ``clip_grad_norm_`` (``True``), without
            (``False``), or both (``None``, the default; a training program only): each part is the last message
            each way on its pair, posted once per peer, and every point above holds with them.
    Raises:
        DeadlockError: the learning step would hang (names the blocked instructions of the learning view).
        DependencyError: in a learning step, a RECV_B before its F (:func:`check_gradient_receives_sized`).
        PairingError: the step does not open with its all-gather (then, with replicas, the replicas'
            agreement, once; without, none), a message of a pair is not received
            exactly once in send order within the step, the loss would not match last, or two ranks post
            their messages in different orders.
    """
    if learning:
        try:
            validate(learning_view(program))
        except DeadlockError as exc:
            raise DeadlockError("while learning the message shapes (each RECV_F waits for its SEND_F's header; "
                                "the grid is the learning view, each such F moved up to its RECV_F): " + exc.reason,
                                exc.rank, exc.instr, exc.grid) from None
        check_gradient_receives_sized(program)
    variants = (False, True) if norm_parts is None else (norm_parts,)
    for parts in variants if not program.forward_only else (False,):
        posts = [_numbered_posts(program, rank, learning, early, gradients, parts)
                 for rank in range(program.num_ranks)]
        check_opening(program, posts)
        check_replicas(program, posts)
        check_loss_last(program, posts)  # the most telling message first
        if parts:
            check_norm_parts_last(program, posts)
        check_pairs_match(program, posts)
        if same_pair_order:
            check_same_pair_order(program, posts)
    return program
