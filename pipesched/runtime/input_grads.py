"""The gradient a fused backward (``B``) gives a stage's inputs, as it flows on in the unsplit model.

A stage input that requires grad is a leaf here (a received or handed-over activation), so autograd stores its
gradient in ``.grad`` *laid out as the input* (its layout contract): a ``Linear`` over a transposed input makes a
row-major gradient, which ``.grad`` holds transposed. In the unsplit model that gradient flows on to the previous
stage as the backward made it. A tensor hook registered after the forward's own hooks on the input (so after any a
layer registered there) sees that gradient, hooks applied, in its own layout: what is sent back or handed over.

Where that gradient already has the input's strides (the usual case), the hook keeps no reference to it, so autograd
hands that very tensor over as ``.grad`` (no copy) and ``.grad`` is returned; otherwise autograd copies it into the
input's layout for ``.grad`` anyway, and the hook's own reference is returned.
"""
from __future__ import annotations

from contextlib import contextmanager

_AS_GRAD = object()  # the flowing gradient has the input's strides: read it from .grad after the backward


@contextmanager
def input_gradients(inputs):
    """Collect, during the block (a backward), the gradient that reaches each of ``inputs`` that requires grad
    (each a leaf whose ``.grad`` is ``None``).

    Yields a list, filled when the block ends without raising: one entry per such input (in order), the gradient
    tensor (same shape and dtype as the input, the layout the backward made), or ``None`` where no gradient reached
    it (the unsplit model's ``.grad is None``). The hooks are removed when the block ends, raising or not."""
    need = [t for t in inputs if t.requires_grad]
    seen: list = [None] * len(need)
    handles = [t.register_hook(_keeper(seen, k, t.stride())) for k, t in enumerate(need)]
    got: list = []
    try:
        yield got
    finally:
        for handle in handles:
            handle.remove()
    got.extend(t.grad if s is _AS_GRAD else s for t, s in zip(need, seen))


def _keeper(seen: list, k: int, strides: tuple):
    def keep(grad):  # returns None: the gradient goes on unchanged
        seen[k] = _AS_GRAD if grad.stride() == strides else grad
    return keep
