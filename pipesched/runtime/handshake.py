"""The messages that open every step: an all-gather in which stage 0's rank describes the input (or rejects
it) and every rank gives its settings fingerprint, then the last stage's rank rules on the target, so a bad
batch is the same ``ValueError`` on every rank before any work, and a changed setting on any rank makes every
rank re-learn the step's message metas."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .comm import DTYPE_CODE, TAG_TARGET
from .failure import CommError
from .microbatch import split
from .transport import wait

SIG_LEN = 64  # int64 words of a step signature


class StepKey(NamedTuple):
    """What a step's message metas follow from, and so the key they are cached under: the input's description
    and every pipeline rank's settings. Two steps with equal keys send messages of the same shapes, dtypes,
    ``requires_grad`` and gradient presence."""

    signature: tuple[int, ...]  # :func:`encode_signature`'s words after the rejection flag: train, m, batch, ...
    settings: tuple[int, ...]  # every pipeline rank's settings fingerprint, by pipeline rank

    @property
    def batch_size(self) -> int:
        """``N``, the size of the step's batch along dim 0."""
        return self.signature[2]


class Rejected(ValueError):
    """Internal marker: a rank refused the step's input or target before any work; the ``Pipeline``
    re-raises it as a plain ``ValueError`` (the pipeline stays usable)."""


class Handshake:
    """One rank's side of the step-opening messages over the pipeline group.

    Args:
        transport: the pipeline group's :class:`~pipesched.runtime.transport.Transport`.
        program: the compiled program (for the first and last stages' ranks and ``m``).
        pp_rank: this rank's pipeline rank.
        device: where the control tensors live (the model's device).
    """

    def __init__(self, transport, program, pp_rank: int, device) -> None:
        self.transport, self.program, self.pp_rank, self.device = transport, program, pp_rank, device
        self.sends: list = []  # this step's control sends, settled by :meth:`settle`

    def settle(self, what: str = "the step signature send") -> None:
        """Wait until this step's control sends are delivered (a dropped gloo send is cancelled)."""
        for work, _ in self.sends:
            wait(work, what)
        self.sends = []

    def signature(self, x, train: bool, to_device, settings: int):
        """Every rank learns the step's input (stage 0's rank describes ``x`` or rejects it) and every rank's
        settings fingerprint (:func:`~pipesched.runtime.settings.fingerprint`), in one all-gather over the
        pipeline group.

        Returns:
            ``(key, microbatches, is_tuple)``: the :class:`StepKey` (the input's description and every pipeline
            rank's fingerprint); ``microbatches`` is ``None`` on the other ranks.
        Raises:
            Rejected: stage 0's rank refused ``x``, or ranks disagree on ``step()`` versus ``forward()`` (on
                every rank, with the same message).
        """
        first = self.program.stage_to_rank[0]
        self.sends = []
        m = self.program.num_microbatches
        words, micro, is_tuple = [0] * SIG_LEN, None, False
        if self.pp_rank == first:
            try:
                if x is None:
                    raise ValueError(f"the rank of stage 0 (pipeline rank {first}) got no input x; pass the batch "
                                     f"as x there")
                micro, is_tuple = split(to_device(x), m, "x")
                words = encode_signature(train, m, micro, is_tuple)
            except (TypeError, ValueError) as exc:
                words = encode_text([1, int(train), m], str(exc))
        rows = self._gather([settings, int(train), int(train and not torch.is_grad_enabled())] + words)
        words = rows[first][3:]
        if words[0]:
            raise Rejected(decode_text(words) if self.pp_rank == first else
                           f"the rank of stage 0 (pipeline rank {first}) rejected the step input: {decode_text(words)}")
        calls = ("forward()", "step()")
        made = [row[1] for row in rows]
        if len(set(made)) > 1:
            raise Rejected("every rank of a pipeline must make the same call; "
                           + ", ".join(f"pipeline rank {r} called {calls[c]}" for r, c in enumerate(made)))
        no_grad = [r for r, row in enumerate(rows) if row[2]]
        if no_grad:  # a training step needs autograd: refuse it on every rank before any work
            raise Rejected(f"step() trains, but pipeline ranks {no_grad} called it with gradients disabled "
                           f"(inside torch.no_grad() or torch.inference_mode()); call step() outside it, or use "
                           f"forward() for evaluation")
        return StepKey(tuple(words[1:]), tuple(row[0] for row in rows)), micro, is_tuple

    def target_verdict(self, target, total: int, check_targets):
        """The last stage's rank checks ``target`` with ``check_targets(target, total)`` and tells the others.

        Returns:
            The target microbatches on the last stage's rank, else ``None``.
        Raises:
            Rejected: the last stage's rank refused ``target`` (on every rank, with its message).
        """
        last = self.program.stage_to_rank[-1]
        if self.pp_rank != last:
            words = self._receive(last, TAG_TARGET, "the target check")
            if words[0]:
                self.settle()  # delivered (the last stage's rank got past them)
                raise Rejected(f"the rank of the last stage (pipeline rank {last}) rejected the step's target: "
                               f"{decode_text(words)}")
            return None
        try:
            targets, text = check_targets(target, total), ""
        except (TypeError, ValueError) as exc:
            targets, text = None, str(exc)
        sent_before = len(self.sends)
        self._broadcast(encode_text([int(bool(text)), 0, 0], text), TAG_TARGET)
        if text:
            del self.sends[:sent_before]  # only the rejection needs to be seen delivered before raising
            self.settle("the target rejection send")
            raise Rejected(text)
        return targets

    def _gather(self, words: list[int]) -> list[list[int]]:
        """All-gather one row of int64 ``words`` from every pipeline rank; returns the rows by rank."""
        mine = torch.tensor(words, dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.program.num_ranks)]
        group = self.transport.group
        try:
            work = group.allgather([rows], [mine])
        except RuntimeError as exc:
            raise CommError("the step signature", exc) from None
        wait(work, "the step signature")
        return [row.tolist() for row in rows]

    def _receive(self, peer: int, tag: int, what: str) -> list[int]:
        tensors, _ = self.transport.wait(self.transport.post([((SIG_LEN,), torch.int64)], peer, tag, what))
        return tensors[0].tolist()

    def _broadcast(self, words, tag: int) -> None:
        message = torch.tensor(words, dtype=torch.int64, device=self.device)
        for peer in range(self.program.num_ranks):
            if peer != self.pp_rank:
                self.sends.append(self.transport.send((message,), peer, tag))


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


def encode_signature(train, m, micro, is_tuple) -> list[int]:
    """The input's description: ``[0, train, m, batch, is_tuple, tensors, (dtype, dims, *shape[1:]) ...]``.

    Raises:
        TypeError: a dtype that cannot cross a stage boundary.
        ValueError: too many tensors or dimensions for ``SIG_LEN`` words.
    """
    first = micro[0]
    total = sum(mb[0].shape[0] for mb in micro)
    words = [0, int(train), m, total, int(is_tuple), len(first)]
    for t in first:
        if t.dtype not in DTYPE_CODE:
            raise TypeError(f"x has a tensor of dtype {t.dtype}, which cannot cross a stage boundary")
        words += [DTYPE_CODE[t.dtype], t.dim() - 1, *t.shape[1:]]
    if len(words) > SIG_LEN:
        raise ValueError(f"x has too many tensors or dimensions to describe ({len(words)} > {SIG_LEN} words)")
    return words + [0] * (SIG_LEN - len(words))
