"""Split a batch (a tensor or a tuple of tensors) into microbatches along dim 0, and merge them back."""
from __future__ import annotations

import torch

Batch = "torch.Tensor | tuple[torch.Tensor, ...]"


def as_tuple(batch, name: str = "batch") -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(tensors, is_tuple)``: a tensor becomes a 1-tuple; a tuple/list is checked to hold only tensors.

    Raises:
        TypeError: ``batch`` is neither a tensor nor a tuple/list of tensors (names the bad item).
    """
    if isinstance(batch, torch.Tensor):
        return (batch,), False
    if isinstance(batch, (tuple, list)) and batch:
        for i, item in enumerate(batch):
            if not isinstance(item, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(item).__name__}")
        return tuple(batch), True
    raise TypeError(f"{name} must be a tensor or a non-empty tuple of tensors, got {type(batch).__name__}")


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


def split_sizes(total: int, num_microbatches: int) -> list[int]:
    """Microbatch sizes for ``total`` samples: as even as possible, larger ones first (10, 4 -> 3, 3, 2, 2).

    Raises:
        ValueError: ``total < num_microbatches`` (a microbatch would be empty) or ``num_microbatches < 1``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if total < num_microbatches:
        raise ValueError(
            f"batch size {total} is smaller than num_microbatches={num_microbatches}; "
            f"every microbatch needs at least one sample (use a batch of >= {num_microbatches})"
        )
    base, extra = divmod(total, num_microbatches)
    return [base + 1 if i < extra else base for i in range(num_microbatches)]


def split(batch, num_microbatches: int, name: str = "batch") -> tuple[list[tuple[torch.Tensor, ...]], bool]:
    """Split along dim 0 into ``num_microbatches`` views (no copies), sizes from :func:`split_sizes`.

    Returns:
        ``(microbatches, is_tuple)``: each microbatch is a tuple of tensors (one per tensor of ``batch``),
        shapes ``(n_i, ...)`` with ``sum(n_i) == batch_size(batch)``.
    Raises:
        TypeError, ValueError: as :func:`batch_size` and :func:`split_sizes`.
    """
    tensors, is_tuple = as_tuple(batch, name)
    sizes = split_sizes(batch_size(batch, name), num_microbatches)
    parts = [t.split(sizes, dim=0) for t in tensors]  # per tensor: m views (n_i, ...)
    return [tuple(p[i] for p in parts) for i in range(num_microbatches)], is_tuple


def merge(microbatches, is_tuple: bool):
    """Concatenate microbatches (tuples of tensors) along dim 0; a tensor if ``not is_tuple``.

    Raises:
        ValueError: no microbatches, or an output with no batch dimension to concatenate along (0-dim).
    """
    if not microbatches:
        raise ValueError("merge needs at least one microbatch")
    for k, t in enumerate(microbatches[0]):
        if t.dim() == 0:
            where = f"element {k} of the model's output tuple" if is_tuple else "the model's output"
            raise ValueError(f"forward() merges each microbatch's output along dim 0, but {where} is 0-dim "
                             f"(shape ()); return it with a batch dimension, e.g. x.expand(n) or x[None]")
    merged = tuple(torch.cat(column, dim=0) for column in zip(*microbatches))
    return merged if is_tuple else merged[0]
