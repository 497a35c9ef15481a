"""How a step's refusals travel and are ruled on alike on every rank: text in int64 words (:func:`encode_text`,
for the rows of the step's opening all-gather and of the other collectives that carry an error), the
:class:`Rejected` marker and its kinds, the last stage's rank's :class:`TargetVerdict` on the step's target, and
every rank's rulings on the gathered verdict and on the ranks' refusals of their own calls. The opening itself
(the row's layout, the all-gather) is :mod:`~pipesched.runtime.handshake`'s."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .microbatch import as_value, batch_size, split

SIG_LEN = 64  # int64 words of a step signature
VERDICT_LEN = SIG_LEN  # int64 words of the verdict on the target (the room for its text it had as a message)
#: the first word of a row's signature block: stage 0's rank's description of x (0) or refusal of it (1), or any
#: rank's refusal of its own call (its own checks before the opening failed: ``[OWN_REFUSAL, kind, 0, *text]``)
OWN_REFUSAL = 2
#: the exception a refusal raises on every rank, by the code its row carries (``kind``; 0: no refusal)
REFUSAL_KINDS = {1: ValueError, 2: TypeError}


class TargetVerdict(NamedTuple):
    """The last stage's rank's check of the step's target before the opening (all that needs no x): ``batch``,
    the target's size along dim 0 (``None``: no target, or rejected before its size was known); ``error``, why
    it is refused (``""``: accepted); ``target``, the target on the stages' device (``None`` where refused or
    absent), split once the opening has shown ``batch`` to be x's."""

    batch: int | None
    error: str = ""
    target: object = None


class Rejected(ValueError):
    """Internal marker: a rank refused the step's input, target or call before any work; the ``Pipeline``
    re-raises it as a plain ``kind`` (``ValueError``, or ``TypeError`` where a rank's own check of its call raised
    one: :func:`judge_own_checks`) with the same message and cause (the pipeline stays usable)."""

    def __init__(self, text: str, kind: type = ValueError) -> None:
        super().__init__(text)
        self.kind = kind


def check_target(target, missing: str, move) -> TargetVerdict:
    """The last stage's rank's check of the step's ``target`` before the opening: all that needs no x, in the
    order the step always checked it (present, a batch, then movable), so the errors are those it always gave.

    Args:
        target: the step's target (``None``, a tensor or a tuple of tensors; anything else is refused).
        missing: the error where ``target`` is None (``""``: ``loss_fn`` takes none).
        move: ``target -> target`` on the stages' device (raises ``ValueError`` where it cannot be moved).
    """
    if target is None:
        return TargetVerdict(None, missing)
    try:
        batch = batch_size(target, "target")
    except (TypeError, ValueError) as exc:
        return TargetVerdict(None, str(exc))
    try:
        return TargetVerdict(batch, "", move(target))
    except (TypeError, ValueError) as exc:  # ruled on after the batch size (:func:`judge_target`)
        return TargetVerdict(batch, str(exc))


def target_microbatches(verdict: TargetVerdict | None, m: int):
    """The accepted target of ``verdict`` split into ``m`` microbatches (a tensor each, or a tuple where the
    target is one); ``None`` without a target. Cannot fail once :func:`judge_target` passed."""
    if verdict is None or verdict.target is None:
        return None
    parts, container = split(verdict.target, m, "target")
    return [as_value(p, container) for p in parts]


def verdict_words(verdict: TargetVerdict | None) -> list[int]:
    """``verdict`` as ``VERDICT_LEN`` int64 words: ``[refused, batch known, batch, *text]`` (:func:`encode_text`);
    zeros for ``None`` (no verdict: another rank, or a ``forward()``)."""
    if verdict is None:
        return [0] * VERDICT_LEN
    batch = verdict.batch
    return encode_text([int(bool(verdict.error)), int(batch is not None), batch or 0], verdict.error, VERDICT_LEN)


def judge_target(words: list[int], total: int, last: int, pp_rank: int, verdict: TargetVerdict | None) -> None:
    """Every rank's ruling on the last stage's rank's :func:`verdict_words` (``words``, from the gathered row of
    ``last``) for a batch of ``total`` samples; ``verdict``: this rank's own (the last stage's rank's full text).

    Raises:
        Rejected: the target's batch size is not ``total`` (checked first, as the target is checked on one
            rank: size, then device), or the last stage's rank refused it; its own message on that rank,
            prefixed by ``the rank of the last stage (pipeline rank N) rejected the step's target:`` elsewhere.
    """
    refused, known, batch = words[:3]
    if known and batch != total:
        text = f"target has batch size {batch} but x has {total}"
    elif refused:
        text = verdict.error if pp_rank == last and verdict is not None else decode_text(words)
    else:
        return
    raise Rejected(text if pp_rank == last else
                   f"the rank of the last stage (pipeline rank {last}) rejected the step's target: {text}")


def kind_code(kind: type) -> int:
    """The :data:`REFUSAL_KINDS` code of the exception class ``kind`` (a ``TypeError``: 2; anything else: 1)."""
    return 2 if issubclass(kind, TypeError) else 1


def judge_own_checks(blocks: list[list[int]], pp_rank: int, refusal: Exception | None,
                     call: str = "step") -> None:
    """Every rank's ruling on the ranks' refusals of their own calls (``blocks``: each pipeline rank's signature
    block from the opening; ``refusal``: this rank's own exception, ``None`` if its checks passed; ``call``: what
    the ranks called, ``step`` or ``forward()``).

    Raises:
        Rejected: some rank refused. Every rank refused alike (the same type and text: the same bad argument
            everywhere): each raises its own message, as it did before the opening. Else every rank raises the
            first refusing rank's type with ``pipeline rank R refused its <call>: <its text>`` (naming the other
            refusing ranks), caused on ``R`` by its own exception; so no rank waits for one that raised alone.
    """
    refused = [r for r, words in enumerate(blocks) if words[0] == OWN_REFUSAL]
    if not refused:
        return
    said = {(blocks[r][1], decode_text(blocks[r])) for r in refused}
    if len(refused) == len(blocks) and len(said) == 1:
        raise Rejected(str(refusal), REFUSAL_KINDS[kind_code(type(refusal))]) from refusal
    first = refused[0]
    also = f" (pipeline ranks {refused[1:]} refused theirs too)" if len(refused) > 1 else ""
    raise Rejected(f"pipeline rank {first} refused its {call}{also}: {decode_text(blocks[first])}",
                   REFUSAL_KINDS.get(blocks[first][1], ValueError)) from (refusal if pp_rank == first else None)


def encode_text(head: list[int], text: str, length: int = SIG_LEN) -> list[int]:
    """``head`` words, then the UTF-8 byte count and bytes of ``text`` (cut to fit), as ``length`` int64 words."""
    room = (length - len(head) - 1) * 8
    data = text.encode()
    if len(data) > room:
        data = data[:room - 3] + b"..."
    padded = data + b"\0" * (-len(data) % 8)
    body = torch.frombuffer(bytearray(padded), dtype=torch.int64).tolist() if padded else []
    words = head + [len(data)] + body
    return words + [0] * (length - len(words))


def decode_text(words: list[int], head: int = 3) -> str:
    """The text :func:`encode_text` put after ``head`` words."""
    n = words[head]
    data = torch.tensor(words[head + 1:], dtype=torch.int64).numpy().tobytes()[:n]
    return data.decode(errors="replace")
