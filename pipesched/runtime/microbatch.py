"""Split a batch (a tensor or a tuple of tensors) into microbatches along dim 0; merge the last stage's
outputs (any pytree of tensors and other values) back."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

Batch = "torch.Tensor | tuple[torch.Tensor, ...]"


#: what a batch or a stage output was, so that the next stage (or ``loss_fn``) gets the same kind back
#: (:func:`as_value`): a bare tensor, a tuple or a list of tensors; it travels as the meta's first word
TENSOR, TUPLE, LIST = 0, 1, 2


def as_tuple(batch, name: str = "batch", hint: str = "") -> tuple[tuple[torch.Tensor, ...], int]:
    """``(tensors, container)``: a tensor becomes a 1-tuple; a tuple/list is checked to hold only tensors;
    ``container`` is :data:`TENSOR`, :data:`TUPLE` or :data:`LIST` (the only false one is :data:`TENSOR`).

    Args:
        name: what ``batch`` is, for the message; ``hint``: a sentence added to the message (why only tensors).
    Raises:
        TypeError: ``batch`` is neither a tensor nor a tuple/list of tensors (names the bad item).
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), TENSOR
    hint = f" ({hint})" if hint else ""
    if isinstance(batch, (tuple, list)) and batch:
        for i, item in enumerate(batch):
            if not isinstance(item, torch.Tensor):
                raise TypeError(f"element {i} of {name} must be a torch.Tensor, got {type(item).__name__}; {name} "
                                f"must be a tensor or a non-empty tuple or list of tensors{hint}")
        return tuple(batch), LIST if isinstance(batch, list) else TUPLE
    raise TypeError(f"{name} must be a tensor or a non-empty tuple or list of tensors, got {type(batch).__name__}"
                    f"{hint}")


def as_value(tensors: tuple, container: int):
    """What :func:`as_tuple` took apart, rebuilt: ``tensors[0]``, the tuple, or a list (a new one per call)."""
    return tensors[0] if container == TENSOR else list(tensors) if container == LIST else tensors


def cloned(value):
    """A copy of a stage's or layer's argument that is not a leaf (what an in-place first layer may change): a tensor
    cloned, or a tuple or list (kept a tuple or list) with each tensor cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in value]
        return copies if isinstance(value, list) else tuple(copies)
    return value


#: why a stage's output (other than the last stage's) must be a tensor or a tuple of tensors
SENT_HINT = ("it is sent to the next stage; only the last stage's output, which goes to loss_fn and forward() "
             "as-is, may be a dict or hold other values")


def stage_output(out, stage: int) -> tuple[tuple[torch.Tensor, ...], bool]:
    """:func:`as_tuple` of the output of ``stage``, which is sent on to the next stage.

    Raises:
        TypeError: not a tensor or a tuple of tensors (names the stage and says only the last may be other)."""
    return as_tuple(out, f"the output of stage {stage}", SENT_HINT)


def batch_size(batch, name: str = "batch") -> int:
    """The size of dim 0, shared by every tensor of ``batch``.

    Raises:
        TypeError: not a tensor or tuple of tensors.
        ValueError: a tensor has no dim 0, or the tensors disagree on its size (names both sizes).
    """
    tensors, _ = as_tuple(batch, name)
    sizes = []
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(f"{name}[{i}] is a scalar; every tensor needs a batch dimension 0")
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(f"the tensors of {name} have different batch sizes (dim 0): {sizes}")
    return sizes[0]


class TooFewSamples(ValueError):
    """A batch smaller than the microbatch count: a microbatch would be empty (``ValueError``'s subclass, so a step
    or forward can add advice of its own)."""


def split_sizes(total: int, num_microbatches: int) -> list[int]:
    """Microbatch sizes for ``total`` samples: as even as possible, larger ones first (10, 4 -> 3, 3, 2, 2).

    Raises:
        TooFewSamples: ``total < num_microbatches`` (a microbatch would be empty).
        ValueError: ``num_microbatches < 1``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if total < num_microbatches:
        raise TooFewSamples(
            f"batch size {total} is smaller than num_microbatches={num_microbatches}; "
            f"every microbatch needs at least one sample (use a batch of >= {num_microbatches})"
        )
    base, extra = divmod(total, num_microbatches)
    return [base + 1 if i < extra else base for i in range(num_microbatches)]


def split(batch, num_microbatches: int, name: str = "batch") -> tuple[list[tuple[torch.Tensor, ...]], bool]:
    """Split along dim 0 into ``num_microbatches`` views (no copies), sizes from :func:`split_sizes`.

    Returns:
        ``(microbatches, container)``: each microbatch is a tuple of tensors (one per tensor of ``batch``),
        shapes ``(n_i, ...)`` with ``sum(n_i) == batch_size(batch)``.
    Raises:
        TypeError, ValueError: as :func:`batch_size` and :func:`split_sizes`.
    """
    tensors, container = as_tuple(batch, name)
    sizes = split_sizes(batch_size(batch, name), num_microbatches)
    parts = [t.split(sizes, dim=0) for t in tensors]  # per tensor: m views (n_i, ...)
    return [tuple(p[i] for p in parts) for i in range(num_microbatches)], container


def merge(outputs: list, what: str = "the last stage's output"):
    """Merge the last stage's per-microbatch outputs into one, as ``forward()`` returns it.

    Each output is flattened with ``torch.utils._pytree`` (tuples, lists, dicts, namedtuples and registered
    containers are walked; everything else is a leaf); all must have the same structure. Per leaf position:

    - tensors on every microbatch: concatenated along dim 0, ``(n_0 + ... + n_{m-1}, ...)``;
    - non-tensors (a string, a number, ``None``, ...) of the same type and equal (``==``) on every microbatch:
      kept once; otherwise a list of the ``m`` per-microbatch values.

    The result has the outputs' structure (a single tensor stays a tensor, a list a list, a dict a dict).

    Raises:
        ValueError: no outputs; outputs of different structures; a position holding a tensor on some
            microbatches and something else on others; a 0-dim tensor (no dim 0 to concatenate along); tensors
            that ``torch.cat`` refuses (other shapes beyond dim 0). The message names the element
            (``element 'aux' of the last stage's output``) and, where they differ, the microbatches.
    """
    if not outputs:
        raise ValueError("merge needs at least one microbatch")
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], 1):
        if other != spec:
            raise ValueError(f"forward() merges the microbatches' outputs element by element, but {what} has "
                             f"another structure on microbatch {i} than on microbatch 0: {_skeleton(flat[i])} vs "
                             f"{_skeleton(flat[0])}")
    merged = []
    for k, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        tensors = [isinstance(v, torch.Tensor) for v in column]
        if all(tensors):
            merged.append(_cat(column, lambda: _element(outputs[0], k, what)))
        elif any(tensors):
            i = tensors.index(not tensors[0])
            raise ValueError(f"{_element(outputs[0], k, what)} is a {type(column[0]).__name__} on microbatch 0 but "
                             f"a {type(column[i]).__name__} on microbatch {i}; forward() concatenates tensors and "
                             f"keeps other values, so each element must be a tensor on every microbatch or on none")
        elif all(type(v) is type(column[0]) and _equal(v, column[0]) for v in column[1:]):
            merged.append(column[0])
        else:
            merged.append(list(column))
    return tree_unflatten(merged, spec)


def _cat(column, element) -> torch.Tensor:
    for i, t in enumerate(column):
        if t.dim() == 0:
            raise ValueError(f"{element()} is 0-dim (shape ()) on microbatch {i}; forward() concatenates each "
                             f"tensor of it along dim 0 (the batch dimension): return it with one, e.g. "
                             f"x.expand(n) or x[None], or as a non-tensor (x.item())")
    try:
        return torch.cat(column, dim=0)
    except RuntimeError as exc:
        shapes = [tuple(t.shape) for t in column]
        raise ValueError(f"{element()} cannot be concatenated along dim 0 over the microbatches (shapes "
                         f"{shapes}): {exc}") from exc


class _TypeName:
    def __init__(self, value) -> None:
        self.name = type(value).__name__

    def __repr__(self) -> str:
        return self.name


def _skeleton(flat) -> str:
    """An output's structure with each leaf shown as its type name: ``{'logits': Tensor, 'aux': str}``."""
    leaves, spec = flat
    return repr(tree_unflatten([_TypeName(v) for v in leaves], spec))


def _equal(a, b) -> bool:
    """``a == b`` as a bool; ``False`` where that comparison raises or is not a truth value (arrays)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a usable ==: not equal, kept per microbatch
        return False


def _element(output, k: int, what: str) -> str:
    """``"element 'aux' of <what>"`` for leaf ``k`` of ``output`` (``what`` itself for a bare leaf)."""
    try:  # key paths: torch >= 2.2, and only for containers registered with them
        from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, keystr, tree_flatten_with_path
        path = tree_flatten_with_path(output)[0][k][0]
    except Exception:  # noqa: BLE001 - a registered container without key paths
        return f"leaf {k} of {what}"
    if not path:
        return what
    if len(path) == 1:
        key = path[0]
        name = (repr(key.key) if isinstance(key, MappingKey) else key.idx if isinstance(key, SequenceKey)
                else key.name if isinstance(key, GetAttrKey) else keystr(path))
        return f"element {name} of {what}"
    return f"element {keystr(path)} of {what}"
