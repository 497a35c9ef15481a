"""Bytes of activations held for backward: counted with saved-tensor hooks, per stage and microbatch."""
from __future__ import annotations

import torch


class SavedBytes:
    """Counts the distinct tensors autograd saves inside :meth:`track` (parameters excluded).

    A tensor is counted once per tracked region by its data pointer, with ``numel x element_size`` bytes,
    so an output saved by one layer and again as the next layer's input counts once.
    """

    def __init__(self, params) -> None:
        self.param_ptrs = {p.data_ptr() for p in params}
        self._seen: dict = {}

    def _pack(self, t: torch.Tensor):
        ptr = t.data_ptr()
        if ptr not in self.param_ptrs:
            size = t.numel() * t.element_size()
            if self._seen.get(ptr, -1) < size:
                self._seen[ptr] = size
        return t

    def track(self):
        """A context in which saved tensors are counted; read and reset with :meth:`take`."""
        self._seen = {}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)

    def take(self) -> int:
        """Bytes counted since the last :meth:`track`, and reset."""
        total = sum(self._seen.values())
        self._seen = {}
        return total


def _identity(t):
    return t


def tensor_bytes(tensors) -> int:
    """Sum of ``numel x element_size`` over ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)
