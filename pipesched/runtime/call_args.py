"""A collective call's own argument, ruled on in the marked row with which it meets the other pipeline ranks
(:func:`~pipesched.runtime.handshake.meet`), before anything else travels: ``gather_timeline(kind=)``, and
``run_collective(work, meet=True)``'s own checks. Each rank's row carries the argument as it shows (its ``repr``)
and this rank's refusal of it (the exception its own check raised, by code, and its text), so every rank rules
alike on the same rows (:func:`judge`):

- every rank refused alike (the same argument): each raises its own error, a plain ``ValueError`` / ``TypeError``
  (``RuntimeError``: e.g. no finished step), and the Pipeline stays usable;
- the ranks passed different arguments: a ``ValueError`` on every rank naming each value with its ranks;
- one rank refused, the others did not: every rank raises that rank's type, naming it and quoting its error.

The same mechanism as ``clip_grad_norm_``'s refusal row (:mod:`~pipesched.runtime.clip_args`) and the
GradScaler's vote (:mod:`~pipesched.runtime.scaler_vote`): the row has the shape of every pipeline collective's
first row, so ranks in different calls still meet and raise the error naming the calls.
"""
from __future__ import annotations

from .handshake import ROW_LEN, meet
from .refusals import REFUSAL_KINDS, SIG_LEN, Rejected, decode_text, encode_text, kind_code

#: the exception a refusal raises on every rank, by the code its row carries (0: none)
KINDS = {**REFUSAL_KINDS, 3: RuntimeError}


def shown(value) -> str:
    """``repr(value)``, or ``<unprintable T>`` where its ``__repr__`` raises."""
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a user object's __repr__ may raise anything
        return f"<unprintable {type(value).__name__}>"


def code_of(exc: BaseException | None) -> int:
    """The :data:`KINDS` code of ``exc`` (0: None)."""
    if exc is None:
        return 0
    if isinstance(exc, RuntimeError) and not isinstance(exc, (TypeError, ValueError)):
        return 3
    return kind_code(type(exc))


def meet_with_argument(group, size: int, device, mark: int, what: str, call: str, name: str, value,
                       refusal: BaseException | None, compare: bool = True) -> None:
    """Meet the other pipeline ranks (``mark``'s row) carrying ``value`` (argument ``name`` of ``call``; not
    compared where ``compare`` is False, e.g. a callable) and this rank's ``refusal`` of its call; then
    :func:`judge` the rows.

    Raises:
        Rejected: see :func:`judge` (the Pipeline raises it as its plain ``kind``; nothing else travels).
        RuntimeError: ranks in other calls (:func:`~pipesched.runtime.handshake.check_rows_meet`).
        CommError: the all-gather failed.
    """
    words = (encode_text([0, code_of(refusal), 0], shown(value) if compare else "", SIG_LEN)
             + encode_text([0, 0, 0], "" if refusal is None else str(refusal), ROW_LEN - 1 - SIG_LEN))
    rows = meet(group, size, device, mark, what, words)
    judge([row[1:] for row in rows], call, name, refusal)


def judge(rows: list, call: str, name: str, refusal: BaseException | None) -> None:
    """Every rank's ruling on the rows of :func:`meet_with_argument` (by pipeline rank, without the mark).

    Raises:
        Rejected: of ``ValueError``: the ranks passed different ``name``s (``<call>: the pipeline ranks passed
            different <name>: 'a' on pipeline rank(s) [0], 'b' on pipeline rank(s) [1]; ...``); else every rank
            refused alike: this rank's own error (its type and text); else some ranks refused: the first's type,
            ``<call>: pipeline rank R refused its call: <its error>``.
    """
    values = [decode_text(row) for row in rows]
    if len(set(values)) > 1:
        seen: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            seen.setdefault(value, []).append(rank)
        by = ", ".join(f"{value} on pipeline rank(s) {ranks}" for value, ranks in seen.items())
        raise Rejected(f"{call}: the pipeline ranks passed different {name}: {by}; pass the same {name} on every "
                       f"rank (nothing was gathered)", ValueError) from refusal
    refused = [r for r, row in enumerate(rows) if row[1]]
    if not refused:
        return
    texts = {(rows[r][1], decode_text(rows[r][SIG_LEN:])) for r in refused}
    if len(refused) == len(rows) and len(texts) == 1:
        raise Rejected(str(refusal), type(refusal)) from refusal
    first = refused[0]
    raise Rejected(f"{call}: pipeline rank {first} refused its call: {decode_text(rows[first][SIG_LEN:])}",
                   KINDS.get(rows[first][1], ValueError)) from refusal
