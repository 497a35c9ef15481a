"""The GradScaler's overflow vote (:class:`~pipesched.runtime.GradScaler`): every rank's found-inf verdict and
scaler settings in ONE all-gather over the pipeline group of ``ROW_LEN``-word rows headed by ``SCALER_MARK`` (the
length of a step opening's, ``clip_grad_norm_``'s and ``gather_timeline``'s rows, so ranks in different calls meet
and every one raises the same error naming the calls: :func:`~pipesched.runtime.handshake.check_rows_meet`), and
with data parallelism one more all-gather over the data-parallel group of what each pipeline decided
(``SIG_LEN``-word rows, as a step's agreement of the replicas). The verdict is the MAX over every rank; where the
ranks' scalers differ (``enabled``, the count of scaled steps, the settings), every rank of the job gets the same
error text.
"""
from __future__ import annotations

import torch

from .clip_replicas import bits_float, float_bits
from .handshake import ROW_LEN, SCALER_MARK, check_rows_meet, replica_rows
from .refusals import SIG_LEN, decode_text, encode_text
from .transport import gather_rows

#: a rank's vote, the words after ``[SCALER_MARK, 0]`` in its row: whether its scaler is enabled, its count of
#: scaled steps, its growth_interval, then as float64 bits its found-inf flags summed, its scale, growth_factor
#: and backoff_factor (a disabled scaler: 0 for each setting)
FIELDS = ("enabled", "steps", "growth_interval", "found", "scale", "growth_factor", "backoff_factor")
ENABLED, STEPS, INTERVAL, FOUND, SCALE, GROWTH, BACKOFF = range(len(FIELDS))


def _float(word: int) -> str:
    return f"{bits_float(word):g}"


#: the scaler settings every rank must share, after the step count: (name, vote column, how a value is written)
_SETTINGS = (("scale", SCALE, _float), ("growth_factor", GROWTH, _float), ("backoff_factor", BACKOFF, _float),
             ("growth_interval", INTERVAL, str))
#: a replica's row in the vote over the data-parallel group: SIG_LEN int64 words, ``[SCALER_MARK, 1, 1, *text,
#: failed, *vote]``; words 1-2 and the text read, to a step's agreement of the replicas
#: (``Handshake._agree_replicas``: the same size and group) met in its place, as "replica D refused its step: <text>"
_REPLICA_DATA = 1 + len(FIELDS)
_MEETING = ("it is in the GradScaler's overflow vote (scaler.unscale_ or scaler.step) while this replica opened its "
            "next step: the replicas' scaler calls differed; call scaler.unscale_/scaler.step on every rank of every "
            "replica alike")


def vote(pipe, mine: list, pp_group, dp_group) -> tuple[str, float]:
    """Every rank's vote (``mine``: this rank's :data:`FIELDS` words), collective: ONE all-gather over ``pp_group``
    of ``ROW_LEN`` int64 words ``[SCALER_MARK, 0, *mine, 0, ...]``; with data parallelism (``dp_group`` not None)
    then one all-gather over ``dp_group`` (:func:`_agree_replicas`).

    Returns:
        ``(error, found)``: the ``ValueError`` text every rank of the job raises alike (``""``: none,
        :func:`_judge`) and the MAX of every rank's found.
    Raises:
        RuntimeError: ranks are in other collective calls (:func:`~pipesched.runtime.handshake.check_rows_meet`, or
            a replica elsewhere), on every rank that meets them.
        CommError: an all-gather failed (a peer is gone, or the timeout passed).
    """
    grid = pipe.grid
    rows = gather_rows([SCALER_MARK, 0, *mine] + [0] * (ROW_LEN - 2 - len(mine)), pp_group, grid.pp_size,
                       torch.int64, pipe.device, "the GradScaler's overflow vote (an all-gather over the pipeline group)")
    check_rows_meet([row[:2] for row in rows], SCALER_MARK)
    votes = [row[2:2 + len(FIELDS)] for row in rows]
    error = _judge(votes, grid, grid.pipeline_ranks(grid.dp_rank))
    if dp_group is None:
        return error, _most_found(votes)
    return _agree_replicas(pipe, error, votes, dp_group)


def _judge(votes: list, grid, ranks) -> str:
    """The ``ValueError`` text every rank raises alike from ``votes`` (:data:`FIELDS` words, one per voting rank;
    ``ranks``: their world ranks), or ``""``. Checked in order: ``enabled``; nothing more where every scaler is
    disabled; the counts of scaled steps; the settings (:data:`_SETTINGS`); some step scaled."""
    def differ(column: int, fmt) -> str:
        values = [vote[column] for vote in votes]
        return _by_value(values, grid, fmt, ranks) if len(set(values)) > 1 else ""

    if by := differ(ENABLED, lambda word: str(bool(word))):
        return (f"scaler: the ranks' GradScalers differ in enabled: {by}; build it with the same arguments on every "
                f"rank")
    if not votes[0][ENABLED]:
        return ""
    if by := differ(STEPS, _steps):
        return (f"scaler: the ranks passed this GradScaler to pipe.step(..., scaler=...) in different numbers of "
                f"steps: {by}; pass it to pipe.step on every rank in every step")
    for name, column, fmt in _SETTINGS:
        if by := differ(column, fmt):
            return (f"scaler: the ranks' GradScalers differ in {name}: {by}; build it with the same arguments on "
                    f"every rank" + (" and call its update() on every rank after each step" if name == "scale" else ""))
    if votes[0][STEPS] == 0:
        return ("scaler: no pipe.step() got this GradScaler, so the gradients were never scaled; call "
                "pipe.step(x, target=y, scaler=scaler) before scaler.unscale_/step")
    return ""


def _most_found(votes: list) -> float:
    """The MAX over ``votes`` of the found-inf flags each rank summed."""
    return max(bits_float(vote[FOUND]) for vote in votes)


def _agree_replicas(pipe, error: str, votes: list, dp_group) -> tuple[str, float]:
    """The replicas' agreement (collective over ``dp_group``: ONE all-gather of a ``SIG_LEN``-word row): each rank
    sends what its whole pipeline decided alike from ``votes`` (its pipeline group's): ``error`` as text, else its
    pipeline's vote with the pipeline's MAX found. Every rank of the job gets the same rows, one per replica.

    Returns:
        ``(error, found)`` as :meth:`GradScaler._vote`: where the replicas' votes differ (enabled, steps,
        settings), :func:`_judge`'s text naming each replica's value; else the first failed replica's text, else
        :func:`_judge` of the replicas' votes by world rank; the MAX of the replicas' found.
    Raises:
        RuntimeError: a replica is in another call (e.g. it opened its next step).
        CommError: the all-gather failed.
    """
    grid = pipe.grid
    agreed = list(votes[0])
    agreed[FOUND] = float_bits(_most_found(votes))
    words = encode_text([SCALER_MARK, 1, 1], error or _MEETING, SIG_LEN - _REPLICA_DATA) + [int(bool(error)), *agreed]
    replicas = replica_rows(
        words, SCALER_MARK, dp_group, grid, pipe.device,
        "the GradScaler's overflow vote over the data-parallel group (the replicas' agreement)",
        lambda in_call, others, doing: (
            f"scaler: replicas {in_call} are in the GradScaler's overflow vote (scaler.unscale_ or scaler.step) while "
            f"replicas {others} {doing}: the replicas' scaler calls differed; call scaler.unscale_/scaler.step on "
            f"every rank of every replica alike, for the same optimizers in the same order"))
    by_replica = [row[-len(FIELDS):] for row in replicas]
    by_world_rank = [by_replica[rank // grid.pp_size] for rank in range(grid.world_size)]
    judged = _judge(by_world_rank, grid, range(grid.world_size))
    failed = [row for row in replicas if row[-_REPLICA_DATA]]
    if failed and not judged.startswith("scaler: the ranks"):  # replicas that differ say so first: a replica whose
        return decode_text(failed[0]), 0.0  # pipeline got no scaler fails alone, which would blame the others too
    return judged, _most_found(by_replica)


def _steps(count) -> str:
    return "in no step (scaler=None)" if count == 0 else f"in {count} step{'s' if count != 1 else ''}"


def _by_value(values, grid, fmt, ranks=None) -> str:
    """``values`` (one per world rank in ``ranks``, default every world rank in order) grouped by value, each
    group's ranks named: by pipeline rank, with the replica when there is data parallelism; e.g. ``in 1 step on
    pipeline rank 0, in no step (scaler=None) on pipeline rank 1``."""
    groups: dict = {}
    for rank, value in zip(range(len(values)) if ranks is None else ranks, values):
        groups.setdefault(value, []).append(rank)

    def where(ranks) -> str:
        if grid.dp_size == 1:
            return f"pipeline rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"
        return ", ".join(f"pipeline rank {r % grid.pp_size} of replica {r // grid.pp_size} (world rank {r})"
                         for r in ranks)

    return ", ".join(f"{fmt(value)} on {where(ranks)}" for value, ranks in groups.items())
