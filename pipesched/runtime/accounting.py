"""Bytes of activations held for backward: counted with saved-tensor hooks, per stage and microbatch."""
from __future__ import annotations

import torch

from .microbatch import as_tuple, as_value, stage_output


class SavedBytes:
    """Counts the distinct tensors autograd saves inside :meth:`track` (parameters excluded).

    A tensor is counted once per tracked region by its data pointer, with ``numel x element_size`` bytes,
    so an output saved by one layer and again as the next layer's input counts once.
    """

    def __init__(self, params) -> None:
        self.param_ptrs = {p.data_ptr() for p in params}
        self._seen: dict = {}
        self._excluded = 0

    def _pack(self, t: torch.Tensor):
        ptr = t.data_ptr()
        if ptr not in self.param_ptrs:
            size = t.numel() * t.element_size()
            if self._seen.get(ptr, -1) < size:
                self._seen[ptr] = size
        # detached: a saved output returned with its grad_fn is a reference cycle (grad_fn -> saved
        # variable -> tensor -> grad_fn) that nothing breaks when the graph is retained (split backward:
        # each microbatch's graph and activations leaked, 16-36 MB a step); same data, autograd re-attaches
        return t.detach()

    def track(self, exclude=()):
        """A context in which saved tensors are counted, except those of ``exclude`` (tensors already
        held, e.g. the stage input a recompute starts from); read and reset with :meth:`take`."""
        self._seen = {t.data_ptr(): t.numel() * t.element_size() for t in exclude}
        self._excluded = sum(self._seen.values())
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)

    def by_address(self) -> dict:
        """Since the last :meth:`track`: ``{data address: bytes}`` of the tensors counted (what :meth:`take` sums,
        before the excluded ones are taken off), without resetting."""
        return dict(self._seen)

    def take(self) -> int:
        """Bytes counted since the last :meth:`track`, and reset."""
        total = sum(self._seen.values()) - self._excluded
        self._seen, self._excluded = {}, 0
        return total


def _identity(t):
    return t


def cuda_memory_base(device) -> int | None:
    """On CUDA: reset ``device``'s peak-memory statistics and return the bytes allocated now; else ``None``."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def cuda_peak_since(device, base: int | None) -> int | None:
    """On CUDA: the peak bytes allocated since :func:`cuda_memory_base` returned ``base``, above ``base``."""
    if base is None:
        return None
    return torch.cuda.max_memory_allocated(device) - base


def tensor_bytes(tensors) -> int:
    """Sum of ``numel x element_size`` over ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def stage_activation_bytes(model, microbatch, num_stages: int, balance=None, loss_fn=None, target=None) -> dict:
    """Per stage, the bytes one microbatch holds for backward, measured in this process — the sizes
    :class:`pipesched.CostModel` needs to predict activation memory (``CostModel(**result)``).

    Runs ``model`` (split as :class:`~pipesched.runtime.Pipeline` splits it) on ``microbatch`` with grad
    enabled, each stage from its own leaf inputs as in the pipeline, counting saved tensors as the executor
    does; the caller's RNG state and the model's buffers (BatchNorm's running statistics, ...) are left
    untouched: the stages run on scratch copies of the buffers.

    Args:
        microbatch: one microbatch, ``(n, ...)`` tensor or tuple of tensors.
        loss_fn, target: when given, the last stage also computes ``loss_fn(output, target)`` (its saves count).
    Returns:
        ``{"stash_bytes": (...), "input_bytes": (...), "recompute_bytes": (...)}``, ints per stage: what a
        forward saves; the stage input; what a recomputing stage holds after its R (input and saved
        tensors, one that is both counted once).
    Raises:
        TypeError, ValueError: as :func:`~pipesched.runtime.stage.resolve_balance`; ``ScheduleArgumentError`` (a
            ValueError): ``num_stages`` not an integer >= 1.
    """
    from .recompute import scratch_buffers
    from .stage import build_stages, layers_of, resolve_balance

    from ..checks import check_positive

    num_stages = check_positive("num_stages", num_stages)  # a bool, 0 or -1 would cut nonsense (0: ZeroDivision)
    layers = layers_of(model)
    stages = build_stages(layers, resolve_balance(layers, num_stages, balance), range(num_stages))
    counter = SavedBytes(p for layer in layers for p in layer.parameters())
    inputs, container = as_tuple(microbatch, "microbatch")
    stash, sizes, redone = [], [], []
    devices = sorted({p.device for layer in layers for p in layer.parameters() if p.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices), scratch_buffers(torch.nn.ModuleList(layers)), torch.enable_grad():
        for s in range(num_stages):
            if s > 0:
                inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
            sizes.append(tensor_bytes(inputs))
            with torch.random.fork_rng(devices=devices):  # the same forward twice: once as F, once as R
                with counter.track(inputs):
                    _run_stage(stages[s], inputs, container, s == num_stages - 1, loss_fn, target)
                redone.append(sizes[-1] + counter.take())
            with counter.track():
                out = _run_stage(stages[s], inputs, container, s == num_stages - 1, loss_fn, target)
            stash.append(counter.take())
            if s < num_stages - 1:  # the last stage's output goes to loss_fn only: it may be a dict, hold non-tensors
                inputs, container = stage_output(out, s)
    return {"stash_bytes": tuple(stash), "input_bytes": tuple(sizes), "recompute_bytes": tuple(redone)}


def _run_stage(stage, inputs, container: int, last: bool, loss_fn, target):
    out = stage(as_value(inputs, container))
    if last and loss_fn is not None:
        loss_fn(out, target) if target is not None else loss_fn(out)
    return out
