"""The gradient a fused backward (``B``) gives a stage's inputs, as it flows on in the unsplit model.

A stage input that requires grad is a leaf here (a received or handed-over activation), so autograd stores its
gradient in ``.grad`` *laid out as the input* (its layout contract): a ``Linear`` over a transposed input makes a
row-major gradient, which ``.grad`` holds transposed. In the unsplit model that gradient flows on to the previous
stage as the backward made it. A tensor hook registered after the forward's own hooks on the input (so after any a
layer registered there) sees that gradient, hooks applied, in its own layout: what is sent back or handed over.
"""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def input_gradients(inputs):
    """Collect, during the block (a backward), the gradient that reaches each of ``inputs`` that requires grad.

    Yields a list with one entry per such input (in order), filled by the block: the gradient tensor (same shape
    and dtype as the input, the layout the backward made), or ``None`` where no gradient reached it (the unsplit
    model's ``.grad is None``). The hooks are removed when the block ends, raising or not."""
    need = [t for t in inputs if t.requires_grad]
    got = [None] * len(need)
    handles = [t.register_hook(_keeper(got, k)) for k, t in enumerate(need)]
    try:
        yield got
    finally:
        for handle in handles:
            handle.remove()


def _keeper(got: list, k: int):
    def keep(grad):
        got[k] = grad  # returns None: the gradient goes on unchanged
    return keep
