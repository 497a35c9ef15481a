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
