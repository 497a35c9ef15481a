"""The execution model shared by the validator and the timing (:mod:`pipesched.timing`: the simulator, lowering).

Each rank runs its stream in order:

- a RECV *posts* a receive and moves on (it never blocks);
- a SEND blocks until the matching receive has been posted — the strictest semantics, so a program
  that completes here completes under any buffering an executor adds;
- a compute instruction waits until the data it needs from another rank has been sent to it (in a
  compute-only program: until the producing instruction has run);
- ALL_REDUCE and TIE_REDUCE start an asynchronous collective and move on.

Messages between two ranks match first in, first out, whatever their kind, as NCCL matches
point-to-point messages, and a SEND and the RECV it matches must carry the same message
(:func:`pipesched.deps.message`). This system is confluent — running one enabled instruction never disables
another — so one complete run proves every run completes. :func:`run` finds that run or raises
:class:`~pipesched.errors.DeadlockError` (no rank can move) or :class:`~pipesched.errors.PairingError` (a
SEND matched a RECV posted for another message, or a RECV is left without its SEND).

Passes over large programs (hundreds of thousands of instructions) work on a :class:`Plan`: the
program numbered flat, with the rules of :mod:`pipesched.deps` as integer tables, so that each
instruction costs a few list lookups. A complete :class:`Run` is remembered for the program it proves
(:func:`remember`), so that simulating a validated program does not execute it again.
"""
from __future__ import annotations

import weakref
from bisect import bisect_right
from collections import defaultdict, deque
from functools import cache, partial
from itertools import chain, repeat
from operator import is_, itemgetter

from .deps import REMOTE_KINDS, RuleTable, describe, message, route
from .errors import DeadlockError, PairingError, render_grid
from .ir import BACKWARD_OPS, COLLECTIVE_OPS, COMM_OPS, PROOF_ATTR, RECV_OPS, SEND_OPS, Op, Program

_OP, _STAGE, _MICROBATCH, _PEER = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)  # fields of an Instr

COMPUTE, RECV, SEND = 0, 1, 2  # how the engine treats a rule's instructions (ALL_REDUCE counts as compute)


def has_comm(program: Program) -> bool:
    """Whether the program carries SEND/RECV (lowered) or leaves cross-rank edges implicit (compute-only)."""
    peers = map(_PEER, chain.from_iterable(program.ranks))
    return not all(map(is_, peers, repeat(None)))


class NoSuchStage(IndexError):
    """An instruction names a stage the program does not have (:class:`Plan` needs every stage to exist)."""


class Plan:
    """A program numbered flat for fast passes: instruction ``g`` of the whole program is position
    ``g - first[r]`` of rank ``r``'s stream, for ``first[r] <= g < first[r + 1]``.

    Raises :class:`NoSuchStage` for an instruction of a stage that does not exist; the rest of the
    structure check of :mod:`pipesched.validate` is assumed.

    Attributes:
        program: the program (held weakly; see :func:`remember`).
        rules: its :class:`~pipesched.deps.RuleTable`.
        instrs, rule, mb, peer: per instruction: itself, its rule, microbatch (0 for ALL_REDUCE), peer.
        ops: the kinds of instruction the program has.
        first: where each rank's instructions start; ``first[-1]`` is the number of instructions.
        lowered: the program carries SEND/RECV.
        kind, wait, give: per rule: ``COMPUTE``/``RECV``/``SEND``; the base id of the item it must
            receive from another rank first (-1: none); the base id of the item it hands to another rank
            or, for a RECV, of the message it posts for (a SEND's or RECV's message; in a compute-only
            program the act/grad a compute makes for a stage on another rank; -1: none).
    """

    def __init__(self, program: Program) -> None:
        self._program = weakref.ref(program)
        self.instrs = instrs = list(chain.from_iterable(program.ranks))
        self.first = [0]
        for stream in program.ranks:
            self.first.append(self.first[-1] + len(stream))
        self.rules = rules = RuleTable(program.num_stages, program.num_microbatches)
        rule_of = cache(partial(_rule, rules))  # each distinct (op, stage) is looked up once
        self.rule = list(map(rule_of, map(_OP, instrs), map(_STAGE, instrs)))
        self.ops = frozenset(rules.op)  # the table makes a rule on first use: only for the kinds the program has
        self.mb = list(map(_MICROBATCH, instrs))
        if not COLLECTIVE_OPS.isdisjoint(self.ops):
            self.mb = [0 if mb is None else mb for mb in self.mb]
        self.peer = list(map(_PEER, instrs))
        self.lowered = not COMM_OPS.isdisjoint(self.ops)
        if Op.R in self.ops:
            self._mark_recomputed(program.recomputed())
        self.kind, self.wait, self.give = [], [], []
        for t in range(len(rules.op)):
            self._add_engine_facts(program.stage_to_rank, t)

    @property
    def program(self) -> Program:
        return self._program()

    def rank_of(self) -> list[int]:
        """Per instruction (flat number), its rank."""
        ranks: list[int] = []
        for rank in range(len(self.first) - 1):
            ranks += [rank] * (self.first[rank + 1] - self.first[rank])
        return ranks

    def _mark_recomputed(self, recomputed: frozenset) -> None:
        """Give the B/I of each (stage, microbatch) that has an R the rule that needs the recompute."""
        for g, instr in enumerate(self.instrs):
            if instr.op in BACKWARD_OPS and (instr.stage, instr.microbatch) in recomputed:
                self.rule[g] = self.rules.rule(instr.op, instr.stage, True)

    def _add_engine_facts(self, s2r, t: int) -> None:
        """How :func:`fire_all` treats the instructions of rule ``t``."""
        rules = self.rules
        op = rules.op[t]
        if op in RECV_OPS:
            self.kind.append(RECV)
            self.wait.append(-1)
            self.give.append(rules.made[t][0])  # the message is what the RECV makes available
        elif op in SEND_OPS:
            self.kind.append(SEND)
            self.wait.append(-1)
            self.give.append(rules.need[t][0])  # the message is what the SEND needs
        else:
            items = [] if op in COLLECTIVE_OPS else [(base, rules.item(base)) for base in rules.need[t]]
            here = s2r[rules.stage[t]]
            remote = [base for base, (kind, s, _) in items if kind in REMOTE_KINDS and s2r[s] != here]
            assert len(remote) <= 1, f"the rules give {op} more than one item from another rank"
            handed = [base for base in rules.made[t] if _to_other_rank(rules.item(base), here, s2r)]
            self.kind.append(COMPUTE)
            self.wait.append(remote[0] if remote else -1)
            self.give.append(handed[0] if handed and not self.lowered else -1)


def _rule(rules: RuleTable, op: Op, stage: int) -> int:
    """The rule of ``op`` at ``stage`` (not recomputed). Raises :class:`NoSuchStage` for a stage >= ``rules.S``."""
    if stage >= rules.S:
        raise NoSuchStage(f"an instruction names a stage >= {rules.S}")
    return rules.rule(op, stage)


def _to_other_rank(item, here: int, s2r) -> bool:
    """Whether ``item``, made on rank ``here``, is consumed by a stage on another rank."""
    path = route(item)
    return path is not None and 0 <= path.recv_stage < len(s2r) and s2r[path.recv_stage] != here


class Run:
    """What one execution of a :class:`Plan` did.

    Attributes:
        plan: what ran.
        order: the instructions (flat numbers) in the order they fired.
        partner: per instruction, the RECV a SEND matched (its flat number); -1 for everything else.
        heads: per rank, the flat number of the first instruction that did not fire.
        mismatch: the SEND and the RECV it matched (flat numbers) when they carry different messages (the
            execution stopped there), else ``None``.
        unmatched: per channel with a RECV no SEND matched, the first such RECV (flat numbers, sorted).
    """

    def __init__(self, plan: Plan, order: list[int], partner: list[int], heads: list[int],
                 mismatch: tuple[int, int] | None = None, unmatched: list[int] | None = None) -> None:
        self.plan, self.order, self.partner, self.heads = plan, order, partner, heads
        self.mismatch, self.unmatched = mismatch, unmatched or []

    def raise_if_incomplete(self) -> "Run":
        """Return self if every instruction fired and every SEND matched a RECV of its message.

        Raises:
            PairingError: a SEND matched a RECV posted for another message, or (every rank done) a RECV was
                left without its SEND.
            DeadlockError: naming each rank's blocked instruction.
        """
        plan, first = self.plan, self.plan.first
        if self.mismatch is not None:
            raise _mismatch(plan, *self.mismatch)
        if self.heads != first[1:]:
            raise _deadlock(plan, [h - f for h, f in zip(self.heads, first)])
        if self.unmatched:
            raise _unmatched(plan, self.unmatched[0])
        return self


def run(plan: Plan) -> Run:
    """Execute ``plan`` to the end.

    Raises:
        PairingError: a SEND matched a RECV posted for another message, or a RECV has no SEND.
        DeadlockError: no rank can move and work remains; names each rank's blocked instruction.
    """
    return fire_all(plan).raise_if_incomplete()


def fire_all(plan: Plan) -> Run:
    """Fire instructions until every rank is done or blocked (the model of the module docstring).

    Ranks take turns from a queue; each runs until it ends or blocks, and a rank that unblocks
    another puts it back on the queue. Items are numbered by the plan's rule table. A SEND that matches a
    RECV posted for another message stops the execution (``Run.mismatch``).
    """
    first = plan.first
    heads, ends = first[:-1], first[1:]
    order: list[int] = []
    partner = [-1] * first[-1]
    posted: dict = defaultdict(deque)  # src * num_ranks + dst -> posted, unmatched RECVs on dst
    mismatch = _take_turns(plan, heads, ends, order.append, partner, posted,
                           ready=deque(range(len(heads))), waiters={}, blocked_send={})
    unmatched = sorted(queue[0] for queue in posted.values() if queue)  # the first RECV left on each channel
    return Run(plan, order, partner, heads, mismatch, unmatched)


def _take_turns(plan: Plan, heads: list[int], ends: list[int], fired, partner: list[int], posted: dict, *,
                ready: deque, waiters: dict[int, list[int]], blocked_send: dict) -> tuple[int, int] | None:
    """The loop of :func:`fire_all`: ranks from ``ready`` run from ``heads[rank]`` until they end or block.

    Moves ``heads``, calls ``fired`` with each instruction that fires, fills ``partner`` and ``posted``;
    ``waiters``: item -> ranks waiting for it; ``blocked_send``: channel -> src, while src waits for dst
    to post. Returns the (SEND, RECV) of a mismatch, which stops the execution, else ``None``.
    """
    rule, mb, peer, message, num_ranks = plan.rule, plan.mb, plan.peer, plan.give, len(heads)
    facts, arrived = list(zip(plan.kind, plan.wait, plan.give)), bytearray(plan.rules.num_items)  # per rule; per item
    while ready:
        rank = ready.popleft()
        g, end = heads[rank], ends[rank]
        while g < end:
            kind, item, give = facts[rule[g]]
            if kind == COMPUTE:
                if item >= 0 and not arrived[item + mb[g]]:  # waits for an item from another rank
                    waiters.setdefault(item + mb[g], []).append(rank)
                    break
                item = give + mb[g] if give >= 0 else -1
            elif kind == RECV:
                channel = peer[g] * num_ranks + rank
                posted[channel].append(g)
                if channel in blocked_send:
                    ready.append(blocked_send.pop(channel))
                fired(g)
                g += 1
                continue
            else:
                if not (queue := posted[rank * num_ranks + peer[g]]):
                    blocked_send[rank * num_ranks + peer[g]] = rank
                    break
                recv = partner[g] = queue.popleft()
                item = give + mb[g]
                if message[rule[recv]] + mb[recv] != item:  # the RECV was posted for another message
                    heads[rank] = g
                    return g, recv
            fired(g)
            if item >= 0:  # deliver it
                arrived[item] = 1
                if item in waiters:
                    ready.extend(waiters.pop(item))
            g += 1
        heads[rank] = g
    return None


def remember(program: Program, done: Run) -> None:
    """Remember on ``program`` that ``done`` is a complete run of it (which :func:`validate` passed).

    Programs are immutable, so the proof holds for the program's lifetime; it lives in a private attribute
    of the program (not in module state) and is left out when the program is pickled or copied.
    """
    object.__setattr__(program, PROOF_ATTR, done)


def proven_run(program: Program) -> Run | None:
    """The complete run remembered for ``program`` by :func:`remember`, or ``None``."""
    done = program.__dict__.get(PROOF_ATTR)
    return done if done is not None and done.plan.program is program else None


def _deadlock(plan: Plan, heads: list[int]) -> DeadlockError:
    program = plan.program
    blocked = {r: h for r, h in enumerate(heads) if h < len(program.ranks[r])}
    awaited = _awaited(plan, [plan.first[r] + h for r, h in blocked.items()])
    lines = []
    for rank, pos in blocked.items():
        instr = program.ranks[rank][pos]
        if instr.op in SEND_OPS:
            peer_pos = heads[instr.peer]
            peer_at = program.ranks[instr.peer][peer_pos] if peer_pos < len(program.ranks[instr.peer]) else "its end"
            lines.append(f"  rank {rank} blocked at {instr} (step {pos}): rank {instr.peer} has not posted "
                         f"the receive; it is blocked at {peer_at}")
        else:
            waits = awaited.get(plan.first[rank] + pos, _SOME_DATA)
            lines.append(f"  rank {rank} blocked at {instr} (step {pos}): {waits}")
    first = next(iter(blocked))
    reason = "deadlock: no rank can make progress and work remains\n" + "\n".join(lines)
    return DeadlockError(reason, first, program.ranks[first][blocked[first]], render_grid(program.ranks, blocked))


_SOME_DATA = "waiting for data from another rank"  # where no instruction hands the awaited item (not expected)


def _awaited(plan: Plan, blocked: list[int]) -> dict[int, str]:
    """Per blocked compute instruction (flat numbers; others are skipped), what it waits for: the instruction of
    another rank that hands it the data (the compute that makes it; in a lowered program the SEND that carries
    it) and that rank, ``"waiting for B1.0 on rank 1"``. One pass over the program (an error path only)."""
    needs: dict[int, list[int]] = {}
    for g in blocked:
        t = plan.rule[g]
        if plan.kind[t] == COMPUTE and plan.wait[t] >= 0:
            needs.setdefault(plan.wait[t] + plan.mb[g], []).append(g)
    said: dict[int, str] = {}
    for h, t in enumerate(plan.rule) if needs else ():
        give = plan.give[t]
        if give >= 0 and plan.kind[t] != RECV and (waiting := needs.pop(give + plan.mb[h], None)):
            text = f"waiting for {plan.instrs[h]} on rank {_at(plan, h)[0]}"
            said.update((g, text) for g in waiting)
    return said


def _at(plan: Plan, g: int) -> tuple[int, int]:
    """(rank, position) of flat instruction ``g``."""
    rank = bisect_right(plan.first, g) - 1
    return rank, g - plan.first[rank]


def _mismatch(plan: Plan, send: int, recv: int) -> PairingError:
    program = plan.program
    (src, spos), (dst, rpos) = _at(plan, send), _at(plan, recv)
    sent, posted = program.ranks[src][spos], program.ranks[dst][rpos]
    reason = (f"matches {posted} on rank {dst}, a receive posted for another message: it sends "
              f"{describe(message(sent))}, the receive is for {describe(message(posted))} (messages between two "
              f"ranks match first in, first out)")
    return PairingError(reason, src, sent, render_grid(program.ranks, {src: spos, dst: rpos}))


def _unmatched(plan: Plan, recv: int) -> PairingError:
    program = plan.program
    dst, pos = _at(plan, recv)
    instr = program.ranks[dst][pos]
    return PairingError(f"has no matching send on rank {instr.peer}", dst, instr,
                        render_grid(program.ranks, {dst: pos}))
