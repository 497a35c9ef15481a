"""Post and wait point-to-point messages over one process group, learning activation metas when told to."""
from __future__ import annotations

import torch

from .wire import HEADER_LEN, decode_meta, empty_for, encode_meta, pack, tag_of, unpack
from .layout import from_wire, restride, to_wire, wire_order, wire_shape
from .failure import CommError


class Pending:
    """A posted receive: its work, buffer, specs (of the wire: dims in memory order), the layout of each tensor to view
    or copy it back in (``orders``: dim orders or :class:`~pipesched.runtime.layout.Gapped`; ``None``: all row-major),
    and the meta its header carried (``None`` when the receiver knew the meta already)."""

    __slots__ = ("work", "buf", "specs", "peer", "what", "meta", "orders")

    def __init__(self, work, buf, specs, peer, what, meta=None):
        self.work, self.buf, self.specs, self.peer, self.what, self.meta = work, buf, specs, peer, what, meta
        self.orders = None


def _wire_specs(specs) -> list:
    """(shape, dtype, layout) per tensor -> the (shape, dtype) of each one's wire view (:func:`to_wire`)."""
    return [(wire_shape(shape, order), dtype) for shape, dtype, order in specs]


class Transport:
    """Messages between the ranks of one pipeline group (group-local ranks).

    Between two ranks, messages are received in the order they are sent (each side posts in program
    order), so the matching is right whether the backend matches by tag (gloo) or by order (NCCL)."""

    def __init__(self, group, num_stages: int, device: torch.device) -> None:
        self.group = group
        self.num_stages = num_stages
        self.device = device

    def send(self, tensors, peer: int, tag: int):
        """Start sending ``tensors`` (packed, see :func:`~pipesched.runtime.wire.pack`); returns
        ``(work, buffer)`` — keep both until the work is waited for."""
        buf = pack(tensors)
        try:
            return self.group.send([buf], peer, tag), buf
        except RuntimeError as exc:
            raise CommError(f"a send to pipeline rank {peer}", exc, peer) from None

    def send_act(self, tensors, meta, peer: int, stage: int, microbatch: int, learning: bool) -> list:
        """Send the output of (stage, microbatch), each tensor in the dim order ``meta`` gives (the receiver's);
        a meta header first while learning. Returns the works."""
        pending = []
        if learning:
            header = encode_meta(meta).to(self.device)
            pending.append(self.send((header,), peer, tag_of("act_header", stage, microbatch, self.num_stages)))
        wired = [to_wire(t, order) for t, order in zip(tensors, meta[2])]
        pending.append(self.send(wired, peer, tag_of("act", stage, microbatch, self.num_stages)))
        return pending

    def post(self, specs, peer: int, tag: int, what: str) -> Pending:
        """Post the receive of a message of ``specs`` ((shape, dtype) per tensor, as on the wire; the caller sets
        the returned receive's ``orders`` to view tensors laid out otherwise back, see :func:`from_wire`)."""
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
            return self._post_meta(meta, peer, tag, what)
        header = self.post([((HEADER_LEN,), torch.int64)], peer, tag_of("act_header", stage, microbatch,
                                                                          self.num_stages), what)
        wait(header.work, what, peer)
        meta = decode_meta(header.buf)
        pending = self._post_meta(meta, peer, tag, what)
        pending.meta = meta
        return pending

    def _post_meta(self, meta, peer, tag, what) -> Pending:
        specs = [(shape, dtype, order) for (shape, dtype, _), order in zip(meta[1], meta[2])]
        pending = self.post(_wire_specs(specs), peer, tag, what)
        pending.orders = meta[2]
        return pending

    def send_grads(self, grads, specs, peer: int, tag: int, orders=None) -> tuple[list, tuple]:
        """Send the gradients of a stage's inputs that need one, ``None`` where the stage's backward gave an
        input no gradient (the unsplit model's ``.grad is None``). ``specs``: (shape, dtype) per gradient.
        While learning (``orders`` is ``None``): every one, row-major (zeros standing in for ``None``), plus one
        ``uint8`` tensor holding the presence mask and then each gradient's dim order (:func:`wire_order`), as one
        packed message, so the receiver learns which come and in what layout; afterwards (``orders``: the learned
        ones) only the present ones, each in its learned dim order (none present: no message). Returns ``(works,
        orders)``."""
        if orders is None:
            orders = tuple(tuple(range(len(shape))) if g is None else wire_order(g) for g, (shape, _) in
                           zip(grads, specs))
            words = [g is not None for g in grads] + [d for order in orders for d in order]
            mask = torch.tensor(words, dtype=torch.uint8, device=self.device)
            full = [torch.zeros(shape, dtype=dtype, device=self.device) if g is None else g
                    for g, (shape, dtype) in zip(grads, specs)]
            return [self.send((*full, mask), peer, tag)], orders
        present = [to_wire(g, order) for g, order in zip(grads, orders) if g is not None]
        return ([self.send(present, peer, tag)] if present else []), orders

    def post_grads(self, specs, mask, peer: int, tag: int, what: str, orders=None) -> Pending | None:
        """Post the receive matching :meth:`send_grads` (``specs``: (shape, dtype) per gradient): ``mask`` (which
        gradients come) and ``orders`` (their dim orders) are ``None`` while learning (the message carries them),
        else the learned ones. Returns ``None`` when no message comes."""
        if mask is None:
            words = len(specs) + sum(len(shape) for shape, _ in specs)
            pending = self.post(list(specs) + [((words,), torch.uint8)], peer, tag, what)
        else:
            present = [(shape, dtype, order) for (shape, dtype), bit, order in zip(specs, mask, orders) if bit]
            if not present:
                return None
            pending = self.post(_wire_specs(present), peer, tag, what)
            pending.orders = [order for _, _, order in present]
        pending.meta = mask
        return pending

    def wait_grads(self, pending: Pending):
        """Wait for a :meth:`post_grads` receive; returns ``(gradients with None where none came, mask, orders)``,
        each gradient laid out in its dim order (``orders``: what the learning message said, else ``None``)."""
        tensors, mask = self.wait(pending)
        if mask is None:
            *grads, words = tensors
            words = words.tolist()
            mask, orders, pos = tuple(bool(b) for b in words[:len(grads)]), [], len(grads)
            for g in grads:
                orders.append(tuple(words[pos:pos + g.dim()]))
                pos += g.dim()
            return (tuple(restride(g, order) if bit else None for g, bit, order in zip(grads, mask, orders)), mask,
                    tuple(orders))
        present = iter(tensors)
        return tuple(next(present) if bit else None for bit in mask), mask, None

    def wait(self, pending: Pending):
        """Wait for a posted receive; returns ``(tensors, meta or None)`` (the meta when a header came).

        Raises:
            CommError: the peer is gone or the wait timed out.
        """
        wait(pending.work, pending.what, pending.peer)
        tensors = unpack(pending.buf, pending.specs)
        if pending.orders is not None:
            tensors = tuple(from_wire(t, order) for t, order in zip(tensors, pending.orders))
        return tensors, pending.meta


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
