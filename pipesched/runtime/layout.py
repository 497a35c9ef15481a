"""Memory layouts across the wire: a tensor is sent as the row-major bytes of a view of it and the receiver rebuilds
the sender's strides, so the next stage's kernels see what they see in the unsplit model.

A *layout* is either a dim order (a tuple: the tensor's dims from outermost to innermost in memory; dense tensors,
and tensors with repeats such as an ``expand``, which arrive dense) or a :class:`Gapped` (the strides of a tensor
with gaps and no repeats, such as a column slice ``h[:, 2:6]`` or a ``chunk`` of the last dim: sent row-major,
received into a region with those strides, one copy on the receiver). Gradients use dim orders only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


#: bytes every allocation's start is a multiple of (torch's CPU allocator aligns to 64, CUDA's to 512): a
#: :class:`Gapped` tensor's offset is kept modulo this, so the receiver's copy starts at the same alignment
ALIGN_BYTES = 64


class Gapped(NamedTuple):
    """The layout of a tensor with gaps between its elements and none shared: its strides, and its storage offset
    modulo :data:`ALIGN_BYTES` (in elements): where its first element sits in an aligned block, which a kernel's
    arithmetic can depend on (a GEMM on a column slice ``h[:, 2:6]`` rounds otherwise at another alignment)."""

    strides: tuple
    offset: int = 0


def wire_order(t: torch.Tensor) -> tuple[int, ...]:
    """The order of ``t``'s dims from outermost to innermost in memory: ``(0, 1, ..., n-1)`` for a row-major tensor,
    ``(1, 0)`` for a transposed matrix, ``(0, 2, 3, 1)`` for ``channels_last``. For a dense tensor it is the order
    whose dense layout has exactly ``t``'s strides, those of its size-1 dims too (a ``channels_last`` ``(N, C, 1,
    1)`` after a global pool has strides ``(C, 1, C, C)``, which torch's kernels read as ``channels_last``, and
    ``is_contiguous()`` does not tell from row-major): dims by decreasing stride, the larger first among equal
    strides. Otherwise (gaps, repeats) torch's ``Tensor.dim_order``."""
    return _order(t)[0]


def activation_layout(t: torch.Tensor):
    """The layout a stage output crosses the wire in: :func:`wire_order`, or a :class:`Gapped` for a non-empty tensor
    with gaps and no element shared (a slice), whose strides the receiver rebuilds."""
    order, dense = _order(t)
    if dense or t.numel() == 0 or not _apart(t):
        return order
    return Gapped(tuple(t.stride()), t.storage_offset() % max(1, ALIGN_BYTES // t.element_size()))


def _order(t: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """(:func:`wire_order`, whether ``t`` is dense in it); a row-major tensor without size-1 dims at once."""
    if t.is_contiguous() and 1 not in t.shape:
        return tuple(range(t.dim())), True
    strides, shape = t.stride(), t.shape
    order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], -shape[d])))
    if _dense_in(strides, shape, order):
        return order, True
    return tuple(t.dim_order()), False


def _dense_in(strides, shape, order) -> bool:
    """Whether ``strides`` are exactly those of a dense tensor of ``shape`` laid out in dim ``order``."""
    expected = 1
    for d in reversed(order):
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def _apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, conservatively: each dim's stride at least spans the dims of
    smaller strides (a slice's rows, a chunk). Strides that interleave (``(20, 5, 2)`` of shape ``(3, 4, 3)``) read
    as sharing, and such a tensor arrives dense."""
    span = 1
    for d in sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=t.stride):
        if t.stride(d) < span:
            return False
        span = t.stride(d) * t.shape[d]
    return True


def _is_identity(order) -> bool:
    return all(d == k for k, d in enumerate(order))


def to_wire(t: torch.Tensor, layout) -> torch.Tensor:
    """``t`` with its dims in the layout's order (a view): the tensor whose row-major values the message carries,
    free for a tensor laid out in that order; :func:`~pipesched.runtime.wire.pack` copies any other one (and a
    :class:`Gapped` one, sent row-major)."""
    return t if isinstance(layout, Gapped) or _is_identity(layout) else t.permute(layout)


def wire_shape(shape, layout) -> tuple[int, ...]:
    """The shape of :func:`to_wire`'s view of a tensor of ``shape``: the receive buffer's."""
    return tuple(shape) if isinstance(layout, Gapped) else tuple(shape[d] for d in layout)


def from_wire(t: torch.Tensor, layout) -> torch.Tensor:
    """Inverse of :func:`to_wire`: the received buffer ``t`` viewed with its dims back in place (a view: its strides
    are those of a dense tensor laid out in the order), or for a :class:`Gapped` layout copied into a region with
    its strides at its offset (one copy; the region holds the gaps, not the sender's other data)."""
    if isinstance(layout, Gapped):
        return restride(t, layout)
    return t if _is_identity(layout) else t.permute(tuple(layout.index(d) for d in range(len(layout))))


def restride(t: torch.Tensor, layout) -> torch.Tensor:
    """A copy of ``t`` laid out in ``layout`` (``t`` itself when it is a row-major dim order): how a tensor that
    arrived row-major gets the layout its sender's had."""
    if isinstance(layout, Gapped):
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, layout.strides))
        region = t.new_empty(layout.offset + extent).as_strided(t.shape, layout.strides, layout.offset)
        return region.copy_(t)
    if _is_identity(layout):
        return t
    return from_wire(t.new_empty(wire_shape(t.shape, layout)), layout).copy_(t)
