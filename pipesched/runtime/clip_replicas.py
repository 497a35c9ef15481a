"""``clip_grad_norm_``'s agreement across data-parallel replicas: with ``dp > 1`` the collective way of
:func:`~pipesched.runtime.clipping.clip_grad_norm_` adds ONE small all-gather over the data-parallel group
(:func:`agree_replicas`, a ``SIG_LEN``-word row per rank). Each rank sends what its pipeline decided from the pipeline
group's rows (its error, or the arguments all its ranks passed), so every rank of the job gets the same rows, one per
replica, and raises the same ``ValueError`` (:func:`judge_replicas`) when any rank refused or the replicas passed
different arguments, before any gradient is scaled. A replica that is elsewhere (it opened its next step, or made
another number of clip calls) is a ``RuntimeError`` on every rank instead of a misread row.
"""
from __future__ import annotations

import torch

from .clip_args import ARGUMENTS, EINF, FOREACH, MAX_NORM, NORM_TYPE, mismatch_message, refusal_message, shown_argument
from .handshake import CLIP_MARK, replica_rows
from .refusals import SIG_LEN, decode_text, encode_text

#: a replica's row in the agreement over the data-parallel group (:func:`agree_replicas`): SIG_LEN int64 words,
#: ``[CLIP_MARK, 1, 1, *text, *data]``, ``data`` the last ``_DATA`` words: ``[calls, error, max_norm, norm_type,
#: error_if_nonfinite, foreach]`` (floats as their bits). Words 1-2 and the text read, to a step's agreement of the
#: replicas (``Handshake._agree_replicas``: the same size and group) met in its place, as "replica D refused its
#: step: <text>", so a replica that opened its next step while the others clip raises too, instead of misreading.
_DATA = 6
_MEETING = ("it is in clip_grad_norm_'s agreement of the replicas while this replica opened its next step: the "
            "replicas' clip_grad_norm_ calls differed (with pipe.anticipate_clip = True: set it alike on every "
            "rank, and call clip_grad_norm_ with the same arguments after changing gradients alike on every replica)")


def agree_replicas(pipe, rows: list, calls: int, dp_group) -> list:
    """The replicas' agreement (collective over ``dp_group``: ONE all-gather of a ``SIG_LEN``-word row): each rank
    sends what its whole pipeline decided alike from ``rows`` (its pipeline group's,
    :func:`~pipesched.runtime.clipping.gather_parts`): the error its pipeline raises
    (:func:`~pipesched.runtime.clip_args.refusal_message`, :func:`~pipesched.runtime.clip_args.mismatch_message`) as
    text, else the arguments every pipeline rank passed, and its count of calls. The replicas of a pipeline rank are
    in the same position in their pipelines, and every rank of a pipeline sends the same row, so every rank of the job
    gets the same rows, one per replica (:func:`judge_replicas`).

    Returns:
        The rows by replica, lists of int64 words.
    Raises:
        RuntimeError: a replica is in another call (e.g. it opened its next step: it did not call
            clip_grad_norm_, or took the anticipated path) or made another number of clip calls.
        CommError: the all-gather failed.
    """
    grid = pipe.grid
    error = refusal_message(pipe, rows, calls) or mismatch_message(rows, grid.dp_rank)
    args = [0, 0, 0, 0] if error else [float_bits(rows[0][MAX_NORM]), float_bits(rows[0][NORM_TYPE]),
                                       int(rows[0][EINF]), int(rows[0][FOREACH])]
    words = encode_text([CLIP_MARK, 1, 1], error or _MEETING, SIG_LEN - _DATA) + [calls, int(bool(error)), *args]
    replicas = replica_rows(
        words, CLIP_MARK, dp_group, grid, pipe.device,
        "the all-gather of clip_grad_norm_ over the data-parallel group (the replicas' agreement)",
        lambda in_call, others, doing: (
            f"clip_grad_norm_: replicas {in_call} are in clip_grad_norm_'s agreement of the replicas while replicas "
            f"{others} {doing}: the replicas' clip_grad_norm_ calls differed. Call it on every rank of every replica "
            f"alike; with pipe.anticipate_clip = True, set it alike on every rank and change gradients between "
            f"step() and clip_grad_norm_() alike on every replica"))
    counts = [row[-_DATA] for row in replicas]
    if len(set(counts)) > 1:
        raise RuntimeError(f"clip_grad_norm_: the replicas made different numbers of clip_grad_norm_ calls (by "
                           f"replica: {counts}); call it on every rank alike")
    return replicas


def judge_replicas(pipe, replicas: list) -> None:
    """Every rank's ruling on the replicas' rows (:func:`agree_replicas`), the same on every rank of the job.

    Raises:
        ValueError: the first replica whose pipeline raises an error (a refusal, or pipeline ranks that passed
            different arguments): that error's message (as the row carries it, so the same text everywhere); else
            replicas that passed different ``max_norm``, ``norm_type``, ``error_if_nonfinite`` or ``foreach``
            (names the argument, each value and its replicas' world ranks). No gradient was changed.
    """
    failed = [row for row in replicas if row[-_DATA + 1]]
    if failed:
        raise ValueError(decode_text(failed[0]))
    grid = pipe.grid
    for k, (name, _) in enumerate(ARGUMENTS):
        seen: dict[int, list[int]] = {}
        for replica, row in enumerate(replicas):
            seen.setdefault(row[-_DATA + 2 + k], []).append(replica)
        if len(seen) > 1:
            values = ", ".join(
                f"{shown_argument(name, bits_float(word) if k < 2 else word)!r} on replica(s) {who} (world ranks "
                f"{[r for replica in who for r in grid.pipeline_ranks(replica)]})" for word, who in seen.items())
            raise ValueError(f"clip_grad_norm_: the replicas passed different {name}: {values}; pass the same "
                             f"{name} on every rank (no gradient was changed)")


def float_bits(value: float) -> int:
    """The int64 word holding ``value``'s float64 bits."""
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64)[0])


def bits_float(word: int) -> float:
    return float(torch.tensor([word], dtype=torch.int64).view(torch.float64)[0])
