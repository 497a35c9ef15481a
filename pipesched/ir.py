"""Instruction kinds, instructions and programs: the plain-data IR every other module works on."""
from __future__ import annotations

import enum
import numbers
import re
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple


#: private attribute of a validated Program holding the execution that proves it (engine.remember)
PROOF_ATTR = "_proof"
#: ``Program.meta`` key of the overlapped pairs: a tuple of ``(F, B)`` instruction pairs (the backward may be an
#: ``I``), adjacent in their rank's compute-only stream, F first, that an executor may overlap (DualPipe-V; torch's
#: ``OVERLAP_F_B``); pipesched's executor runs them one after the other. The two are of different microbatches (a
#: backward needs its own microbatch's forward); only messages, collectives and the backward's own ``R`` may sit
#: between them; an instruction is in at most one pair. :func:`pipesched.validate.validate` refuses a pair that is
#: not one; the passes of :mod:`pipesched.lower` carry the pairs (a split ``B`` becomes its ``I``; a forward-only
#: program has none). The text and JSON forms carry them
#: (:mod:`pipesched.program_io`, header ``overlap_pairs:``); they are not compared (``meta`` is not).
OVERLAP_PAIRS = "overlap_pairs"


class Op(str, enum.Enum):
    """The kind of an instruction.

    Compute kinds run on the rank that holds ``stage``; communication kinds also name a ``peer`` rank.

    - ``F``: forward of ``stage`` on ``microbatch``. Needs the stage input: the previous stage's ``F``
      (same rank) or a ``RECV_F`` (other rank).
    - ``B``: full backward (input and weight gradients) of (stage, microbatch). Needs that ``F`` and the
      gradient of the stage output: the next stage's ``B``/``I`` (same rank) or a ``RECV_B``.
    - ``I``: input-gradient half of a split backward (zero-bubble schedules); same needs as ``B``.
    - ``W``: weight-gradient half of a split backward; needs the ``I`` of the same (stage, microbatch).
    - ``R``: recompute the forward of (stage, microbatch) from its saved input with the saved RNG
      state, so that the following ``B``/``I`` finds its activations. Needs the ``F``.
    - ``SEND_F``: send the output of (stage, microbatch) to ``peer``, the rank of stage + 1.
      Pairs with ``RECV_F`` of (stage + 1, microbatch) on ``peer``.
    - ``RECV_F``: post the receive of the input of (stage, microbatch) from ``peer``, the rank of
      stage - 1. Posting never blocks; the ``F`` that uses the input waits for it to land.
    - ``SEND_B``: send the gradient of the input of (stage, microbatch) to ``peer``, the rank of stage - 1.
      Pairs with ``RECV_B`` of (stage - 1, microbatch) on ``peer``.
    - ``RECV_B``: post the receive of the gradient of the output of (stage, microbatch) from ``peer``,
      the rank of stage + 1; the ``B``/``I`` that uses it waits for it to land.
    - A SEND may block until its RECV is posted (the validator assumes it does).
    - ``ALL_REDUCE``: start averaging the gradients of ``stage`` over the data-parallel group
      (asynchronous; waited for at the end of the step). Has no microbatch and no peer.
    - ``TIE_REDUCE``: start summing the gradients of every tied parameter this rank holds over each tie's
      ranks (:attr:`Program.ties`; one collective per tie, in tie order; asynchronous, waited for at the end of
      the step). ``stage`` is the rank's tied stage whose backward ends last; one per rank holding a tie
      (:mod:`pipesched.ties`). Has no microbatch and no peer.
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the field's name for the input-gradient backward
    W = "W"
    R = "R"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALL_REDUCE = "ALL_REDUCE"
    TIE_REDUCE = "TIE_REDUCE"

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W, Op.R})
SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
RECV_OPS = frozenset({Op.RECV_F, Op.RECV_B})
COMM_OPS = SEND_OPS | RECV_OPS
BACKWARD_OPS = frozenset({Op.B, Op.I})  # the ops that consume the output gradient
FORWARD_OPS = frozenset({Op.F, Op.SEND_F, Op.RECV_F})  # the only kinds a forward-only program runs
COLLECTIVE_OPS = frozenset({Op.ALL_REDUCE, Op.TIE_REDUCE})  # asynchronous collectives: no microbatch, no peer

_TOKEN = re.compile(r"^(?P<op>[A-Z_]+?)(?P<stage>\d+)(?:\.(?P<mb>\d+))?(?:(?P<dir>[<>])(?P<peer>\d+))?$", re.ASCII)


_INDEX_TYPES = (int, type(None))


def _index(name: str, value) -> int | None:
    """``value`` as a plain ``int`` (a numpy integer too), or None; ``ValueError`` for a bool, a float (``0.0``),
    a string or anything else, naming the field: ``F0.False`` or a float index must never reach a program."""
    if value is None or type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer (or None where the kind takes none), got {value!r}")
    return int(value)


class _Fields(NamedTuple):
    op: Op
    stage: int
    microbatch: int | None = None
    peer: int | None = None


class Instr(_Fields):
    """One instruction of a rank's stream: an immutable, hashable, ordered value.

    Attributes:
        op: the kind (see :class:`Op`).
        stage: global stage index, 0-based.
        microbatch: microbatch index, 0-based; ``None`` only for ``ALL_REDUCE`` and ``TIE_REDUCE``.
        peer: the other rank of a SEND/RECV; ``None`` for every other kind.

    Text form: ``F0.3`` (forward, stage 0, microbatch 3), ``SEND_F0.3>1`` (to rank 1),
    ``RECV_B2.0<3`` (from rank 3), ``ALL_REDUCE1``, ``TIE_REDUCE3``. ``Instr.parse(str(i)) == i``.

    A named tuple rather than a frozen dataclass (same fields, order, hash and repr) because a large
    program holds hundreds of thousands of them: builders and passes that make instructions they know to
    be valid use :meth:`trusted`, which skips the checks of ``Instr(...)``.

    Raises:
        ValueError: ``Instr(...)`` with a stage, microbatch or peer that is not an integer (a bool, a float such as
            ``0.0``, a string; a numpy integer is taken as a plain ``int``), a negative stage, a missing or negative
            microbatch, a peer on a non-SEND/RECV (or none on a SEND/RECV), or a microbatch or peer on
            ``ALL_REDUCE``/``TIE_REDUCE``.
    """

    __slots__ = ()

    def __new__(cls, op: Op | str, stage: int, microbatch: int | None = None, peer: int | None = None) -> "Instr":
        if not isinstance(op, Op):
            if op not in Op._value2member_map_:
                raise ValueError(f"op must be one of {', '.join(Op.__members__)} (an Op or its name), got {op!r}")
            op = Op(op)
        if type(stage) is not int or type(microbatch) not in _INDEX_TYPES or type(peer) not in _INDEX_TYPES:
            stage, microbatch, peer = _index("stage", stage), _index("microbatch", microbatch), _index("peer", peer)
        if stage < 0:
            raise ValueError(f"stage must be >= 0, got {stage}")
        if op in COLLECTIVE_OPS:
            if microbatch is not None or peer is not None:
                raise ValueError(f"{op} takes no microbatch or peer, got {microbatch}, {peer}")
        elif microbatch is None or microbatch < 0:
            raise ValueError(f"{op} needs a microbatch >= 0, got {microbatch}")
        elif (op in COMM_OPS) != (peer is not None):
            raise ValueError(f"{op}: peer must be given exactly for SEND/RECV, got peer={peer}")
        return tuple.__new__(cls, (op, stage, microbatch, peer))

    @classmethod
    def _make(cls, iterable) -> "Instr":
        """An instruction from an iterable of its fields, checked as ``Instr(...)`` (``_replace`` uses it)."""
        return cls(*iterable)

    @classmethod
    def trusted(cls, op: Op, stage: int, microbatch: int | None = None, peer: int | None = None) -> "Instr":
        """``Instr(op, stage, microbatch, peer)`` without its checks, at about half the cost: for builders and
        passes that make many instructions from fields they know to be valid (``op`` an :class:`Op` member).
        The programs they make are validated all the same."""
        return tuple.__new__(cls, (op, stage, microbatch, peer))

    @classmethod
    def trusted_all(cls, fields) -> list["Instr"]:
        """``[Instr.trusted(*f) for f in fields]`` for an iterable of ``(op, stage, microbatch, peer)`` tuples, as one
        C-level loop (a fifth of the cost of calling :meth:`trusted` per instruction): for the passes that make
        hundreds of thousands at once."""
        return list(map(tuple.__new__, repeat(cls), fields))

    def __str__(self) -> str:
        op, stage, microbatch, peer = self
        text = f"{op.value}{stage}"
        if microbatch is not None:
            text += f".{microbatch}"
        if peer is not None:
            text += (">" if op in SEND_OPS else "<") + str(peer)
        return text

    @classmethod
    def parse(cls, text: str) -> "Instr":
        """Parse the text form (see the class docstring). Raises ``ValueError`` naming the bad token, ``TypeError``
        for a ``text`` that is not a ``str``."""
        if not isinstance(text, str):
            raise TypeError(f"Instr.parse: text must be a str such as 'F0.3', got {type(text).__name__} {text!r}")
        match = _TOKEN.match(text.strip())
        if match is None or match["op"] not in Op.__members__:
            raise ValueError(
                f"cannot parse instruction {text!r}; expected e.g. F0.3, B1.0, SEND_F0.3>1, RECV_B2.0<3, ALL_REDUCE1 "
                f"(kinds: {', '.join(Op.__members__)})"
            )
        op = Op(match["op"])
        if match["dir"] and (match["dir"] == ">") != (op in SEND_OPS):
            raise ValueError(f"{text!r}: use '>' with SEND_* and '<' with RECV_*")
        mb = None if match["mb"] is None else int(match["mb"])
        peer = None if match["peer"] is None else int(match["peer"])
        return cls(op, int(match["stage"]), mb, peer)

    @property
    def key(self) -> tuple[Op, int, int | None]:
        """(op, stage, microbatch): what the instruction computes, without the peer."""
        return self[:3]


@dataclass(frozen=True)
class Program:
    """Per-rank ordered instruction streams plus what is needed to interpret them.

    Attributes:
        ranks: ``ranks[r]`` is the ordered tuple of instructions rank ``r`` executes.
        stage_to_rank: ``stage_to_rank[s]`` is the pipeline rank holding stage ``s``.
        num_microbatches: microbatches per step (``m``).
        dp_size: data-parallel replicas of this pipeline (each runs the same program).
        schedule: the schedule's registry name, or a free label for a hand-written program.
        forward_only: the program runs forwards only (``Pipeline.forward()``): only F, SEND_F and RECV_F,
            one F per (stage, microbatch), no backward (:func:`pipesched.lower.forward_only` makes one).
        ties: the tie groups: each a sorted tuple of >= 2 stages, on >= 2 ranks, that use one parameter (the
            caller's knowledge of the model); their gradients are summed by ``TIE_REDUCE`` (:mod:`pipesched.ties`).
            Part of the program (compared, printed, fingerprinted): which ranks must meet in a collective.
    """

    ranks: tuple[tuple[Instr, ...], ...]
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    dp_size: int = 1
    schedule: str = "custom"
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    forward_only: bool = False
    ties: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(stream) for stream in self.ranks))
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "ties", tuple(tuple(tie) for tie in self.ties))

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks ``p``: one instruction stream each (``len(ranks)``)."""
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """Pipeline stages, over all ranks (``len(stage_to_rank)``: ``p * v`` for ``v`` stages per rank)."""
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def stages_with(self, op: Op) -> frozenset[int]:
        """The stages that have an instruction of kind ``op`` anywhere in the program (``R``: the recomputed
        ones; ``I``: those with a split backward)."""
        return frozenset(i.stage for stream in self.ranks for i in stream if i.op is op)

    def recomputed(self) -> frozenset[tuple[int, int]]:
        """The (stage, microbatch) pairs that have an ``R``: their backward needs the recompute, not the ``F``."""
        return frozenset((i.stage, i.microbatch) for stream in self.ranks for i in stream if i.op is Op.R)

    def replace(self, ranks) -> "Program":
        """A copy with new streams and the same placement, sizes, label and ties."""
        return Program(tuple(ranks), self.stage_to_rank, self.num_microbatches, self.dp_size, self.schedule,
                       dict(self.meta), self.forward_only, self.ties)

    def __len__(self) -> int:
        return sum(len(stream) for stream in self.ranks)

    def __getstate__(self) -> dict:
        """Pickle and copy the fields only, not a remembered proof (see :func:`pipesched.engine.remember`)."""
        state = dict(self.__dict__)
        state.pop(PROOF_ATTR, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __str__(self) -> str:
        from .program_io import to_text

        return to_text(self)
