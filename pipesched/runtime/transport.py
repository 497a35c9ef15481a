"""Post and wait point-to-point messages over one process group, learning activation metas when told to."""
from __future__ import annotations

import torch

from .comm import HEADER_LEN, decode_meta, empty_for, encode_meta, pack, tag_of, unpack
from .failure import CommError


class Pending:
    """A posted receive: its work, buffer and specs (``None`` while only the meta header is posted)."""

    __slots__ = ("work", "buf", "specs", "peer", "tag", "what")

    def __init__(self, work, buf, specs, peer, tag, what):
        self.work, self.buf, self.specs, self.peer, self.tag, self.what = work, buf, specs, peer, tag, what


class Transport:
    """Messages between the ranks of one pipeline group (group-local ranks)."""

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
        return self._recv(empty_for(specs, self.device), specs, peer, tag, tag, what)

    def post_act(self, meta, peer: int, stage: int, microbatch: int, what: str) -> Pending:
        """Post the receive of stage ``stage``'s output: its payload if ``meta`` is known, else its header."""
        tag = tag_of("act", stage, microbatch, self.num_stages)
        if meta is not None:
            return self.post([(s, d) for s, d, _ in meta[1]], peer, tag, what)
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        header_tag = tag_of("act_header", stage, microbatch, self.num_stages)
        return self._recv(header, None, peer, header_tag, tag, what)

    def _recv(self, buf, specs, peer, recv_tag, payload_tag, what) -> Pending:
        try:
            return Pending(self.group.recv([buf], peer, recv_tag), buf, specs, peer, payload_tag, what)
        except RuntimeError as exc:
            raise CommError(what, exc, peer) from None

    def wait(self, pending: Pending):
        """Wait for a posted receive; returns ``(tensors, meta or None)`` (the meta when a header came).

        Raises:
            CommError: the peer is gone or the wait timed out.
        """
        meta = None
        wait(pending.work, pending.what, pending.peer)
        if pending.specs is None:  # a header: now post the payload it describes
            meta = decode_meta(pending.buf)
            pending = self.post([(s, d) for s, d, _ in meta[1]], pending.peer, pending.tag, pending.what)
            wait(pending.work, pending.what, pending.peer)
        return unpack(pending.buf, pending.specs), meta


def wait(work, what: str, peer: int | None = None) -> None:
    """``work.wait()``, turning a failure (peer gone, timeout) into :class:`CommError` (``peer``: the pipeline
    rank waited on, when there is one)."""
    try:
        work.wait()
    except RuntimeError as exc:
        raise CommError(what, exc, peer) from None
