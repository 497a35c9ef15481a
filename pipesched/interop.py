"""Read and write torch.distributed.pipelining's schedule CSV files (torch 2.13) as pipesched programs.

Torch's ``_PipelineScheduleRuntime._dump_csv``/``_load_csv`` write and read a schedule as one CSV row per rank,
one action per cell (:mod:`pipesched.torch_action`), in two forms: ``compute_only`` (F, B, I, W and
``OVERLAP_F_B`` groups; torch's lowering adds the rest) and ``compute_comms`` (also SEND_F, RECV_F, SEND_B,
RECV_B, and the UNSHARD, RESHARD and REDUCE_GRAD its lowering always adds). Both map onto a :class:`Program`:

- stages, microbatches and F, B, I, W keep their numbers and kinds; a SEND/RECV names the same stage in both
  (the sender's stage for SEND, the receiver's for RECV) and gets its peer from the placement;
- an ``OVERLAP_F_B`` group becomes its compute actions, adjacent and in order, listed in
  ``program.meta[OVERLAP_META]`` (the pairs of :data:`pipesched.ir.OVERLAP_PAIRS`; written back as the group);
- UNSHARD and RESHARD (FSDP only) are dropped with a :class:`TorchCsvWarning` naming how many;
- REDUCE_GRAD becomes ``ALL_REDUCE`` of its stage with ``dp_size > 1``, and is dropped with a
  :class:`TorchCsvWarning` with ``dp_size = 1`` (its scaling of the gradients by 1/m is the loss's business in
  pipesched). The mapping is sound: torch puts REDUCE_GRAD once per stage, right after the stage's last backward
  (``B`` or ``W``), where its FSDP post-backward reduces the stage's gradients over the data-parallel group;
  pipesched's ALL_REDUCE is that same reduction over the replicas (all-reduce: pipesched replicates, torch's FSDP
  shards), one per stage after its last backward, which :func:`pipesched.validate.validate` proves.

Only this module's callers need torch (to run what they read); this module does not import it.
"""
from __future__ import annotations

import csv
import os
import warnings
from collections import Counter

from .checks import as_int, check_flag, check_path, check_program, check_program_size, described, short
from .engine import has_comm
from .errors import ProgramFormatError
from .strict_json import not_text
from .ir import COMM_OPS, OVERLAP_PAIRS, Instr, Op, Program
from .lower import add_all_reduce
from .interop_gaps import idle_note, refuse_gap
from .interop_order import torch_runnable
from .torch_action import COMM_KINDS, COMPUTE_KINDS, FSDP_KINDS, OVERLAP_F_B, REDUCE_GRAD, TorchAction, parse_action

__all__ = ["TorchCsvWarning", "from_torch_csv", "to_torch_csv"]

#: ``program.meta`` key of the adjacent instruction groups torch runs as one OVERLAP_F_B: :data:`pipesched.ir.OVERLAP_PAIRS`
OVERLAP_META = OVERLAP_PAIRS
#: ``program.meta`` key of a program read from a CSV: ``{"path", "form", "dropped": {kind: count}}``
TORCH_META = "torch_csv"
_PEER_STEP = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}  # the peer holds stage + step


class TorchCsvWarning(UserWarning):
    """Something in a torch schedule CSV has no pipesched counterpart and was dropped (it says what)."""


class _Cell:
    """One action of the file and where it is (1-based line and column), for errors that name the spot."""

    __slots__ = ("action", "line", "column", "rank")

    def __init__(self, action: TorchAction, line: int, column: int, rank: int) -> None:
        self.action, self.line, self.column, self.rank = action, line, column, rank

    def leaves(self) -> tuple[TorchAction, ...]:
        return self.action.subs or (self.action,)

    def where(self, path) -> str:
        return f"{path}, line {self.line}, column {self.column} (rank {self.rank}, {self.action})"


def from_torch_csv(path, num_ranks: int | None = None, stage_to_rank=None, num_microbatches: int | None = None,
                   dp_size: int = 1, schedule: str = "torch-csv") -> Program:
    """Read a torch 2.13 schedule CSV (either form) as a :class:`Program`, not validated (call
    :func:`pipesched.validate`; a compute-only file gives a compute-only program, :func:`pipesched.add_send_recv`
    lowers it).

    Args:
        path: the CSV file (row ``r`` is rank ``r``'s actions; empty cells, torch's idle slots, are skipped). A
            line without actions (a blank line: what torch's ``_dump_csv``, and :func:`to_torch_csv`, write for a
            rank without work) is a rank without actions, as torch's ``_load_csv`` reads it; without
            ``num_ranks``, a :class:`TorchCsvWarning` names each such line (a stray blank line would add a rank, or
            shift the ranks of the rows after it). Such lines after the last row with actions and past
            ``num_ranks`` are ignored (torch would refuse them as ranks past its group's).
        num_ranks: pipeline ranks; default the number of rows (more gives the extra ranks empty streams).
        stage_to_rank: ``stage_to_rank[s]`` is the rank of stage ``s``; default: where the file runs each stage
            (torch infers it the same way), which needs an action of every stage.
        num_microbatches: ``m``; default the largest microbatch index in the file + 1 (every microbatch below it
            must then have an action: else the first action past the gap is named, a likely typo).
        dp_size: data-parallel replicas; with ``dp_size > 1`` each REDUCE_GRAD becomes an ALL_REDUCE (or, in a
            file without any, :func:`pipesched.add_all_reduce` places them).
        schedule: the program's label.

    Returns:
        The program; ``meta[TORCH_META]`` says what was read and dropped, ``meta[OVERLAP_META]`` lists the
        OVERLAP_F_B groups.

    Warns:
        TorchCsvWarning: UNSHARD/RESHARD (FSDP-only) actions were dropped; REDUCE_GRAD actions were dropped
            (``dp_size=1``); lines without actions were read as ranks without work (``num_ranks`` not given).

    Raises:
        ProgramFormatError: a cell that is not a torch action, a stage on two ranks or not on the rank
            ``stage_to_rank`` gives, a SEND/RECV without a neighbour stage, a stage with no action and no
            ``stage_to_rank`` or a microbatch with no action and no ``num_microbatches`` (naming the first action
            of a stage or microbatch past the gap), each naming the file, line, column and action.
        ValueError: ``num_ranks``, ``num_microbatches`` or ``dp_size`` not an integer >= 1, ``num_ranks``
            below the file's rows, ``num_ranks x num_microbatches`` above :data:`~pipesched.checks.MAX_PROGRAM_SIZE`
            (a ``ScheduleArgumentError``), or ``stage_to_rank`` naming a rank past them.
        OSError: the file cannot be read.
        TypeError: ``path`` is not a ``str`` or ``os.PathLike`` (an int would be taken as a file descriptor),
            ``schedule`` not a ``str``, ``stage_to_rank`` not a sequence.
    """
    check_path(path, where="from_torch_csv: ")  # first: open() would read and then close a descriptor's file
    if not isinstance(schedule, str):  # the program's label: to_json and a Pipeline's agreement print it
        raise TypeError(f"from_torch_csv: schedule must be a str (the program's label), got {described(schedule)}")
    sizes = []  # plain ints (numpy integers accepted) or None
    for name, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("dp_size", dp_size)):
        sizes.append(None if value is None else as_int(value))
        if value is not None and (sizes[-1] is None or value < 1):
            raise ValueError(f"from_torch_csv: {name} must be an integer >= 1, got {value!r}")
    num_ranks, num_microbatches, dp_size = sizes
    check_program_size(num_ranks or 1, num_microbatches or 1, 1, where="from_torch_csv: ")  # before any row is made
    if stage_to_rank is not None:
        if isinstance(stage_to_rank, (str, bytes)) or not hasattr(stage_to_rank, "__iter__"):
            raise TypeError(f"from_torch_csv: stage_to_rank must be None or a sequence of integer ranks (one per "
                            f"stage), got {described(stage_to_rank)}")
        ranks = tuple(as_int(r) for r in stage_to_rank)
        if None in ranks:
            bad = next(r for r in stage_to_rank if as_int(r) is None)
            kind = " (a bool is not a rank)" if isinstance(bad, bool) else ""
            raise ValueError(f"from_torch_csv: stage_to_rank={short(tuple(stage_to_rank))} must hold integer ranks "
                             f"(one per stage): {described(bad)} is not an integer{kind}")
        stage_to_rank = ranks
    rows, lines = _read_rows(path)
    used = max((r + 1 for r, row in enumerate(rows) if row), default=0)  # rows up to the last with actions
    if num_ranks is not None and used <= num_ranks < len(rows):  # lines without actions past the ranks given
        del rows[num_ranks:], lines[num_ranks:]
    if num_ranks is not None and num_ranks < len(rows):
        raise ValueError(f"from_torch_csv: num_ranks={num_ranks}, but {path} has {len(rows)} rows (one per rank"
                         f"{idle_note(rows[:used], lines)})")
    if num_ranks is None and used:  # a blank line is a rank, as torch reads it, but likelier a stray: say so
        note = idle_note(rows, lines, used)
        if note:
            warnings.warn(f"{path}: {note}", TorchCsvWarning, stacklevel=2)
    rows += [[] for _ in range((num_ranks or len(rows)) - len(rows))]
    if stage_to_rank is not None and any(not 0 <= r < len(rows) for r in stage_to_rank):
        raise ValueError(f"from_torch_csv: stage_to_rank={tuple(stage_to_rank)} names a rank outside 0..{len(rows) - 1}"
                         f" ({path} has {len(rows)} ranks; pass num_ranks for more)")
    if not any(rows):
        raise ProgramFormatError(f"{path}: no actions (a torch schedule CSV has one row of actions per rank)")
    s2r = _placement(rows, stage_to_rank, path)
    if num_microbatches is None:  # m is the largest microbatch + 1: a microbatch below it without an action is a typo
        refuse_gap(rows, "microbatch", lambda leaf: leaf.microbatch, path, ("", ", and m is the largest + 1"),
                   "num_microbatches")
    numbered = [leaf.microbatch for row in rows for c in row for leaf in c.leaves() if leaf.microbatch is not None]
    if num_microbatches is None and not numbered:
        raise ProgramFormatError(f"{path}: no action names a microbatch (only {', '.join(sorted(_kinds(rows)))}), so "
                                 f"the number of microbatches is unknown; pass num_microbatches")
    m = num_microbatches or 1 + max(numbered)
    streams, groups, dropped = _convert(rows, s2r, dp_size, path)
    form = "compute_comms" if _kinds(rows) - set(COMPUTE_KINDS) else "compute_only"
    meta = {TORCH_META: {"path": os.fspath(path), "form": form, "dropped": dict(dropped)}, OVERLAP_META: groups}
    program = Program(streams, s2r, m, 1, schedule, meta)
    if dp_size > 1:
        has_reduce = any(i.op is Op.ALL_REDUCE for st in streams for i in st)
        program = Program(streams, s2r, m, dp_size, schedule, meta) if has_reduce else add_all_reduce(program, dp_size)
    for message in _dropped_messages(path, dropped):
        warnings.warn(message, TorchCsvWarning, stacklevel=2)
    return program


def _dropped_messages(path, dropped: Counter) -> list[str]:
    """One line per kind of dropped action: the FSDP-only ones, and REDUCE_GRAD (dropped only with ``dp_size=1``)."""
    out = []
    fsdp = {k: n for k, n in dropped.items() if k in FSDP_KINDS}
    if fsdp:
        out.append(f"{path}: dropped {', '.join(f'{n} {k}' for k, n in fsdp.items())}: FSDP-only actions "
                   f"(fetching and releasing sharded parameters), which pipesched does not run")
    if dropped.get(REDUCE_GRAD):
        out.append(f"{path}: dropped {dropped[REDUCE_GRAD]} {REDUCE_GRAD}: with dp_size=1 there are no replicas to "
                   f"reduce gradients over (torch's REDUCE_GRAD also scales them by 1/m, which pipesched's loss "
                   f"does); give dp_size (--dp N) to read each as its stage's ALL_REDUCE")
    return out


def _read_rows(path) -> tuple[list[list[_Cell]], list[int]]:
    try:
        return _decode_rows(path)
    except UnicodeDecodeError as exc:
        raise ProgramFormatError(f"{path}: {not_text(exc)}; a torch schedule CSV is UTF-8 text") from None


# how pipesched's text form (a comment or a header line) or JSON form starts: only for a hint
_OWN_FORM_STARTS = ("#", "{", "schedule:", "microbatches:", "stage_to_rank:", "dp_size:", "rank 0:")


def _decode_rows(path) -> tuple[list[list[_Cell]], list[int]]:
    """The actions of each row, and the line each row ends on."""
    rows, lines = [], []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for rank, row in enumerate(reader):
            cells = []
            for column, text in enumerate(row, start=1):
                try:
                    action = parse_action(text)
                except ValueError as exc:
                    hint = (" (this looks like pipesched's own text or JSON form: read it with pipesched.load, or "
                            "`pipesched validate FILE` without --torch-csv)"
                            if reader.line_num == 1 and column == 1 and text.lstrip().startswith(_OWN_FORM_STARTS)
                            else "")
                    raise ProgramFormatError(f"{path}, line {reader.line_num}, column {column} (rank {rank}): "
                                             f"{exc}{hint}") from None
                if action is not None:
                    cells.append(_Cell(action, reader.line_num, column, rank))
            rows.append(cells)
            lines.append(reader.line_num)
    return rows, lines


def _kinds(rows) -> set[str]:
    return {leaf.kind for row in rows for c in row for leaf in c.leaves()}


def _placement(rows, stage_to_rank, path) -> tuple[int, ...]:
    """``stage_to_rank`` checked against the file, or inferred from it (each stage where its actions are)."""
    seen: dict[int, _Cell] = {}
    for row in rows:
        for cell in row:
            for leaf in cell.leaves():
                first = seen.setdefault(leaf.stage, cell)
                if stage_to_rank is None and first.rank != cell.rank:
                    raise ProgramFormatError(f"{cell.where(path)}: stage {leaf.stage} has actions on rank "
                                             f"{first.rank} (line {first.line}) and on rank {cell.rank}")
                if stage_to_rank is not None and (leaf.stage >= len(stage_to_rank)
                                                  or stage_to_rank[leaf.stage] != cell.rank):
                    given = "no rank" if leaf.stage >= len(stage_to_rank) else f"rank {stage_to_rank[leaf.stage]}"
                    raise ProgramFormatError(f"{cell.where(path)}: stage_to_rank gives stage {leaf.stage} {given}, "
                                             f"but this action of it is on rank {cell.rank}")
    if stage_to_rank is not None:
        return tuple(stage_to_rank)
    refuse_gap(rows, "stage", lambda leaf: leaf.stage, path, (", so its rank is unknown", ""), "stage_to_rank")
    return tuple(seen[s].rank for s in range(len(seen)))


def _convert(rows, s2r, dp_size: int, path):
    """Per-rank streams, the OVERLAP_F_B groups, and the dropped kinds with their counts."""
    streams, groups, dropped = [], [], Counter()
    for rank, row in enumerate(rows):
        stream = []
        for cell in row:
            instrs = [_instr(leaf, cell, s2r, dp_size, path) for leaf in cell.leaves()]
            for leaf, instr in zip(cell.leaves(), instrs):
                if instr is None:
                    dropped[leaf.kind] += 1
            stream.extend(i for i in instrs if i is not None)
            if cell.action.kind == OVERLAP_F_B:
                groups.append(tuple(instrs))
        streams.append(tuple(stream))
    return tuple(streams), tuple(groups), dropped


def _instr(leaf: TorchAction, cell: _Cell, s2r, dp_size: int, path) -> Instr | None:
    """The pipesched instruction of one torch action; ``None`` for one that is dropped."""
    if leaf.kind in COMPUTE_KINDS:
        return Instr(Op(leaf.kind), leaf.stage, leaf.microbatch)
    if leaf.kind in COMM_KINDS:
        neighbour = leaf.stage + _PEER_STEP[leaf.kind]
        if not 0 <= neighbour < len(s2r):
            raise ProgramFormatError(f"{cell.where(path)}: {leaf.kind} of stage {leaf.stage} has no stage "
                                     f"{neighbour} to {'send to' if leaf.kind.startswith('SEND') else 'receive from'}"
                                     f" (stages 0..{len(s2r) - 1})")
        return Instr(Op(leaf.kind), leaf.stage, leaf.microbatch, s2r[neighbour])
    if leaf.kind == REDUCE_GRAD and dp_size > 1:
        return Instr(Op.ALL_REDUCE, leaf.stage)
    return None  # UNSHARD, RESHARD; REDUCE_GRAD with dp_size 1


def torch_rows(program: Program, comms: bool | None = None) -> list[list[str]]:
    """The CSV rows (one list of action strings per rank) :func:`to_torch_csv` writes; see there."""
    check_program(program, where="to_torch_csv: ")
    check_flag(comms, "comms", where="to_torch_csv: ", none="the program's own form")
    if comms is None:  # a program on one rank needs no messages: lowered or not, it is what torch runs, unless it
        # came from a compute_only file (torch's lowering adds the REDUCE_GRAD when that is loaded)
        read_as = program.meta.get(TORCH_META, {}).get("form")
        comms = has_comm(program) or (len(set(program.stage_to_rank)) == 1 and read_as != "compute_only")
    if program.forward_only:
        raise ValueError("to_torch_csv: the program is forward-only; torch's schedule files describe training steps "
                         "(its reader expects every forward's backward): write the training program")
    if any(i.op is Op.TIE_REDUCE for st in program.ranks for i in st):
        raise ValueError("to_torch_csv: the program has TIE_REDUCE (tied parameters across ranks), which torch's "
                         "pipelining schedules cannot express; write a program without ties")
    if comms and not has_comm(program) and len(set(program.stage_to_rank)) > 1:
        raise ValueError("to_torch_csv: comms=True, but the program has no SEND/RECV (compute-only); lower it "
                         "with pipesched.add_send_recv first, or write comms=False")
    recomputes = sum(i.op is Op.R for st in program.ranks for i in st)
    if recomputes:
        warnings.warn(f"to_torch_csv: dropped {recomputes} R (recompute) instructions: torch's schedules have no "
                      f"recompute action (a torch stage recomputes inside its module, e.g. torch.utils.checkpoint)",
                      TorchCsvWarning, stacklevel=3)
    if comms and has_comm(program):
        program, note = torch_runnable(program)
        if note is not None:
            warnings.warn(note, TorchCsvWarning, stacklevel=3)
    streams = program.ranks
    if comms and program.dp_size == 1 and not program.forward_only:
        streams = add_all_reduce(program, 2).ranks  # REDUCE_GRAD where torch's lowering adds it, as ALL_REDUCE
    groups = {(program.stage_to_rank[g[0].stage], tuple(g)) for g in program.meta.get(OVERLAP_META, ())}
    return [_row(rank, stream, comms, groups) for rank, stream in enumerate(streams)]


def _row(rank: int, stream, comms: bool, groups) -> list[str]:
    kept = [i for i in stream if _written(i, comms)]
    sizes = sorted({len(g) for r, g in groups if r == rank}, reverse=True)
    row, pos = [], 0
    while pos < len(kept):
        size = next((k for k in sizes if (rank, tuple(kept[pos:pos + k])) in groups), 1)
        actions = [_action_text(i) for i in kept[pos:pos + size]]
        row.append(actions[0] if size == 1 else "(" + ";".join(actions) + ")" + OVERLAP_F_B)
        pos += size
    return row


def _written(instr: Instr, comms: bool) -> bool:
    if instr.op.value in COMPUTE_KINDS:
        return True
    return comms and (instr.op in COMM_OPS or instr.op is Op.ALL_REDUCE)


def _action_text(instr: Instr) -> str:
    if instr.op is Op.ALL_REDUCE:
        return f"{instr.stage}{REDUCE_GRAD}"
    return f"{instr.stage}{instr.op.value}{instr.microbatch}"


def to_torch_csv(program: Program, path, comms: bool | None = None) -> None:
    """Write ``program`` as a torch 2.13 schedule CSV, one row per rank (what torch's ``_load_csv`` reads).

    Args:
        program: any program (validate it first: this writes what it is given).
        path: the file to write.
        comms: ``True``: the compute_comms form (F, B, I, W, SEND/RECV, and a REDUCE_GRAD for each stage after
            its last backward: the program's ALL_REDUCE, or where torch's own lowering puts it when
            ``dp_size = 1``); ``False``: the compute_only form (F, B, I, W only); default: compute_comms for a
            lowered program and for any program on one rank (it has no messages either way, and torch scales the
            gradients by 1/m only at REDUCE_GRAD: without it, loaded as compute_comms, they come out m times
            too large) but one read from a compute_only file, compute_only for a compute-only program on several
            ranks. The groups in ``meta[OVERLAP_META]`` whose
            instructions are still adjacent are written as ``(..;..)OVERLAP_F_B``.

    Warns:
        TorchCsvWarning: ``R`` instructions were dropped (torch has no recompute action); receives posted early
            (``compile_program(..., early_receives=N)``), where torch's blocking receives would stall its dry run,
            were written just before the compute that uses them.

    Raises:
        ValueError: the program is forward-only or has TIE_REDUCE, or ``comms=True`` for a compute-only program on
            several ranks, or torch's dry run (a receive blocks where it is posted) stalls on it even with each
            receive just before its use.
        OSError: the file cannot be written.
        TypeError: ``program`` is not a :class:`Program`, ``path`` not a ``str`` or ``os.PathLike``, ``comms`` not
            ``None`` or a bool.
    """
    check_program(program, where="to_torch_csv: ")
    check_path(path, where="to_torch_csv: ")
    rows = torch_rows(program, comms)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
