"""Post and wait point-to-point messages over one process group, learning activation metas when told to."""
from __future__ import annotations

import torch

from .comm import HEADER_LEN, decode_meta, empty_for, encode_meta, pack, tag_of, unpack
from .failure import CommError


class Pending:
    """A posted receive: its work, buffer, specs, and the meta its header carried (``None`` when the
    receiver knew the meta already)."""

    __slots__ = ("work", "buf", "specs", "peer", "what", "meta")

    def __init__(self, work, buf, specs, peer, what, meta=None):
        self.work, self.buf, self.specs, self.peer, self.what, self.meta = work, buf, specs, peer, what, meta


class Transport:
    """Messages between the ranks of one pipeline group (group-local ranks).

    Between two ranks, messages are received in the order they are sent (each side posts in program
    order), so the matching is right whether the backend matches by tag (gloo) or by order (NCCL)."""

    def __init__(self, group, num_stages: int, device: torch.device) -> None:
        self.group = group
        self.num_stages = num_stages
        self.device = device

    def send(self, tensors, peer: int, tag: int):
        """Start sending ``tensors`` (packed, see :func:`~pipesched.runtime.comm.pack`); returns
        ``(work, buffer)`` — keep both until the work is waited for."""
        buf = pack(tensors)
        try:
            return self.group.send([buf], peer, tag), buf
        except RuntimeError as exc:
            raise CommError(f"a send to pipeline rank {peer}", exc, peer) from None

    def send_act(self, tensors, meta, peer: int, stage: int, microbatch: int, learning: bool) -> list:
        """Send the output of (stage, microbatch); a meta header first while learning. Returns the works."""
        pending = []
        if learning:
            header = encode_meta(meta).to(self.device)
            pending.append(self.send((header,), peer, tag_of("act_header", stage, microbatch, self.num_stages)))
        pending.append(self.send(tensors, peer, tag_of("act", stage, microbatch, self.num_stages)))
        return pending

    def post(self, specs, peer: int, tag: int, what: str) -> Pending:
        """Post the receive of a message of ``specs`` ((shape, dtype) per tensor)."""
        buf = empty_for(specs, self.device)
        try:
            return Pending(self.group.recv([buf], peer, tag), buf, specs, peer, what)
        except RuntimeError as exc:
            raise CommError(what, exc, peer) from None

    def post_act(self, meta, peer: int, stage: int, microbatch: int, what: str) -> Pending:
        """Post the receive of stage ``stage``'s output. If ``meta`` is unknown, first receive the meta header
        (this blocks until it arrives) and post the payload it describes, so the payload's receive is posted
        before any later message from ``peer``: the pending receive then carries the meta."""
        tag = tag_of("act", stage, microbatch, self.num_stages)
        if meta is not None:
            return self.post([(s, d) for s, d, _ in meta[1]], peer, tag, what)
        header = self.post([((HEADER_LEN,), torch.int64)], peer, tag_of("act_header", stage, microbatch,
                                                                          self.num_stages), what)
        wait(header.work, what, peer)
        meta = decode_meta(header.buf)
        pending = self.post([(s, d) for s, d, _ in meta[1]], peer, tag, what)
        pending.meta = meta
        return pending

    def send_grads(self, grads, specs, peer: int, tag: int, learning: bool) -> list:
        """Send the gradients of a stage's inputs that need one, ``None`` where the stage's backward gave an
        input no gradient (the unsplit model's ``.grad is None``). While learning: every one (zeros standing
        in for ``None``) plus a ``uint8`` presence mask, as one packed message, so the receiver learns which
        come; afterwards only the present ones (none present: no message). ``specs``: (shape, dtype) per
        gradient. Returns the works."""
        if learning:
            mask = torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=self.device)
            full = [torch.zeros(shape, dtype=dtype, device=self.device) if g is None else g
                    for g, (shape, dtype) in zip(grads, specs)]
            return [self.send((*full, mask), peer, tag)]
        present = [g for g in grads if g is not None]
        return [self.send(present, peer, tag)] if present else []

    def post_grads(self, specs, mask, peer: int, tag: int, what: str) -> Pending | None:
        """Post the receive matching :meth:`send_grads`: ``mask`` (which gradients come) is ``None`` while
        learning (the message carries it), else the learned one. Returns ``None`` when no message comes."""
        if mask is None:
            pending = self.post(list(specs) + [((len(specs),), torch.uint8)], peer, tag, what)
        else:
            present = [spec for spec, bit in zip(specs, mask) if bit]
            if not present:
                return None
            pending = self.post(present, peer, tag, what)
        pending.meta = mask
        return pending

    def wait_grads(self, pending: Pending):
        """Wait for a :meth:`post_grads` receive; returns ``(gradients with None where none came, mask)``."""
        tensors, mask = self.wait(pending)
        if mask is None:
            *grads, bits = tensors
            mask = tuple(bool(b) for b in bits.tolist())
            return tuple(g if bit else None for g, bit in zip(grads, mask)), mask
        present = iter(tensors)
        return tuple(next(present) if bit else None for bit in mask), mask

    def wait(self, pending: Pending):
        """Wait for a posted receive; returns ``(tensors, meta or None)`` (the meta when a header came).

        Raises:
            CommError: the peer is gone or the wait timed out.
        """
        wait(pending.work, pending.what, pending.peer)
        return unpack(pending.buf, pending.specs), pending.meta


def wait(work, what: str, peer: int | None = None) -> None:
    """``work.wait()``, turning a failure (peer gone, timeout) into :class:`CommError` (``peer``: the pipeline
    rank waited on, when there is one)."""
    try:
        work.wait()
    except RuntimeError as exc:
        raise CommError(what, exc, peer) from None


def gather_rows(values, group, size: int, dtype, device, what: str) -> list[list]:
    """All-gather one row of ``values`` (numbers of ``dtype``) from each of the ``size`` ranks of ``group``, on
    ``device``; returns the rows by group rank, as lists.

    Raises:
        CommError: the all-gather could not start or failed (a peer is gone, or the timeout passed); names ``what``.
    """
    mine = torch.tensor(values, dtype=dtype, device=device)
    rows = [torch.empty_like(mine) for _ in range(size)]
    try:
        work = group.allgather([rows], [mine])
    except RuntimeError as exc:
        raise CommError(what, exc) from None
    wait(work, what)
    return [row.tolist() for row in rows]
