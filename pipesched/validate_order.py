"""The order and pairing checks of :func:`pipesched.validate.validate`, each written twice (fast, exact): on each
rank what an instruction needs comes before it, and between two ranks the receives are posted in the order of the
sends. :mod:`pipesched.validate` runs them; see its docstring for why twice.
"""
from __future__ import annotations

from collections import defaultdict

from . import engine
from .deps import REMOTE_KINDS, describe, message, needs, produces, route
from .errors import DependencyError, PairingError, failure_at, render_grid
from .ir import RECV_OPS, SEND_OPS, Program


def in_order(program: Program, plan: engine.Plan) -> bool:
    """Whether :func:`~pipesched.validate.check_order` passes, from the plan's integer tables."""
    rules, s2r = plan.rules, program.stage_to_rank
    # per rule, the items that must be made earlier on the same rank: all it needs, but in a
    # compute-only program not what it gets from another rank
    local = [
        tuple(base for base in need if plan.lowered or not _made_elsewhere(rules.item(base), s2r[stage], s2r))
        for need, stage in zip(rules.need, rules.stage)
    ]
    made, rule, mb, first = rules.made, plan.rule, plan.mb, plan.first
    for rank in range(program.num_ranks):
        have = bytearray(rules.num_items)
        for t, m in zip(rule[first[rank]:first[rank + 1]], mb[first[rank]:first[rank + 1]]):
            for base in local[t]:
                if not have[base + m]:
                    return False
            for base in made[t]:
                have[base + m] = 1
    return True


def _made_elsewhere(item, rank: int, s2r) -> bool:
    """Whether ``rank`` gets ``item`` from another rank."""
    kind, stage, _ = item
    return kind in REMOTE_KINDS and s2r[stage] != rank


def explain_order(program: Program) -> None:
    """Raise the error :func:`~pipesched.validate.check_order` reports for the first instruction that comes too
    early (if any)."""
    lowered = engine.has_comm(program)
    S, M, s2r = program.num_stages, program.num_microbatches, program.stage_to_rank
    recomputed = program.recomputed()
    for rank, stream in enumerate(program.ranks):
        have: set = set()
        for pos, instr in enumerate(stream):
            for item in needs(instr, S, M, (instr.stage, instr.microbatch) in recomputed):
                remote = _made_elsewhere(item, rank, s2r)
                if item in have or (remote and not lowered):
                    continue
                raise failure_at(DependencyError, program, rank, pos, _order_reason(item, remote, stream, pos))
            have.update(produces(instr))


def _order_reason(item, remote: bool, stream, pos: int) -> str:
    what = describe(item)
    if remote:
        recv = route(item).recv
        return f"needs {what} from another rank, but no {recv} receives it before this point"
    later = any(item in produces(i) for i in stream[pos + 1:])
    return f"needs {what}, which comes {'later in this stream' if later else 'nowhere before it on this rank'}"


def paired(program: Program, plan: engine.Plan) -> bool:
    """Whether :func:`~pipesched.validate.check_pairing` passes, from the plan's integer tables."""
    if not plan.lowered:
        return True
    p, kind, message = program.num_ranks, plan.kind, plan.give  # per rule; a SEND's or RECV's message
    sends: dict = defaultdict(list)  # src * p + dst -> messages (ids) in the order of the sends
    recvs: dict = defaultdict(list)  # src * p + dst -> messages (ids) in the order the receives are posted
    rule, mb, peer, first = plan.rule, plan.mb, plan.peer, plan.first
    for rank in range(p):
        for g in range(first[rank], first[rank + 1]):
            if peer[g] is not None:
                t = rule[g]
                if kind[t] == engine.SEND:
                    sends[rank * p + peer[g]].append(message[t] + mb[g])
                else:
                    recvs[peer[g] * p + rank].append(message[t] + mb[g])
    return sends == recvs


def _unmatched(program: Program, src: int, dst: int, out, inn, smsg, rmsg) -> str:
    """Where the mismatch is rather a missing message (a deleted line, the likeliest hand edit): the receive's
    message is never sent, or the send's message never received, on this channel."""
    if rmsg not in {m for _, m in out}:
        pos = next(p for p, m in inn if m == rmsg)
        return f"; rank {src} never sends what {program.ranks[dst][pos]} receives: a send may be missing"
    if smsg not in {m for _, m in inn}:
        pos = next(p for p, m in out if m == smsg)
        return f"; rank {dst} never receives what {program.ranks[src][pos]} sends: a receive may be missing"
    return ""


def explain_pairing(program: Program) -> None:
    """Raise the error :func:`~pipesched.validate.check_pairing` reports (if any): the first channel whose sends and
    receives differ."""
    sends: dict = defaultdict(list)
    recvs: dict = defaultdict(list)
    for rank, stream in enumerate(program.ranks):
        for pos, instr in enumerate(stream):
            if instr.op in SEND_OPS:
                sends[(rank, instr.peer)].append((pos, message(instr)))
            elif instr.op in RECV_OPS:
                recvs[(instr.peer, rank)].append((pos, message(instr)))
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        out, inn = sends.get(channel, []), recvs.get(channel, [])
        for (spos, smsg), (rpos, rmsg) in zip(out, inn):
            if smsg != rmsg:
                raise PairingError(
                    f"receives from rank {src} are posted out of the order of its sends: rank {src} sends "
                    f"{program.ranks[src][spos]} here, but rank {dst}'s matching receive is "
                    f"{program.ranks[dst][rpos]} (messages between two ranks match first in, first out)"
                    + _unmatched(program, src, dst, out, inn, smsg, rmsg),
                    src, program.ranks[src][spos], render_grid(program.ranks, {src: spos, dst: rpos}),
                )
        if len(out) > len(inn):
            pos = out[len(inn)][0]
            raise failure_at(PairingError, program, src, pos, f"has no matching receive on rank {dst}")
        if len(inn) > len(out):
            pos = inn[len(out)][0]
            raise failure_at(PairingError, program, dst, pos, f"has no matching send on rank {src}")
