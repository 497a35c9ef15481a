"""At construction, with ``dp_size > 1``: every replica starts from replica 0's parameters and buffers, as
``torch.nn.parallel.DistributedDataParallel`` broadcasts rank 0's at construction.

Without it, replicas built with different initial weights (each process seeded by its rank, a common pattern)
were accepted: each step averaged their gradients but applied them to different weights, so the replicas
silently trained different models. Each pipeline rank broadcasts, over its data-parallel group, from replica 0's
rank (world rank = its pipeline rank), every parameter and buffer of its stages (each tensor once: a parameter
tied between two stages of one rank, or a buffer two stages share, is one tensor), flattened per dtype into
buckets of at most :data:`BUCKET_BYTES` and sent as bytes (any dtype, any backend), then copied back in place:
the tensors stay the same objects (an optimizer built before or after, ties, ``load_state_dict`` later all see
them). Replica 0's own tensors are not written.
"""
from __future__ import annotations

import hashlib
import itertools

import torch
import torch.distributed as dist

from .wire import SAME_SIZE_INT, as_bytes
from .transport import gather_rows

BUCKET_BYTES = 256 << 20  # as DDP's broadcast of its module states (250 MiB): bounded extra memory
COPY_WHAT = "the broadcast of replica 0's parameters and buffers at construction"  # a lost peer waits for it
COPY_WHERE = ("while copying replica 0's parameters and buffers to every replica at construction "
              "(a broadcast over each data-parallel group)")


def replica_tensors(stages: dict) -> list[torch.Tensor]:
    """This rank's stage parameters then buffers, stage by stage, each tensor once; dense ones only (a sparse or
    meta tensor has no bytes to copy)."""
    seen, out = set(), []
    for stage in sorted(stages):
        module = stages[stage]
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if id(tensor) in seen or tensor.layout != torch.strided or tensor.is_meta:
                continue
            seen.add(id(tensor))
            out.append(tensor)
    return out


def buckets(tensors, limit: int | None = None) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype (first-seen order), each group cut into runs of at most ``limit`` bytes
    (default :data:`BUCKET_BYTES`; a larger tensor alone)."""
    limit = BUCKET_BYTES if limit is None else limit
    by_dtype: dict = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    out = []
    for group in by_dtype.values():
        run, size = [], 0
        for tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if run and size + nbytes > limit:
                out.append(run)
                run, size = [], 0
            run.append(tensor)
            size += nbytes
        out.append(run)
    return out


def layout(tensors) -> list[int]:
    """``[count, bytes, digest]`` of ``tensors``: their number, their bytes and a digest of their dtypes and shapes in
    order, as int64 words (what fixes the broadcasts' buckets and sizes)."""
    spec = repr([(str(t.dtype), tuple(t.shape)) for t in tensors]).encode()
    digest = int.from_bytes(hashlib.blake2b(spec, digest_size=7).digest(), "little")
    return [len(tensors), sum(t.numel() * t.element_size() for t in tensors), digest]


def check_layouts(rows: list, grid) -> None:
    """Every replica's :func:`layout` row, by replica: all must equal replica 0's.

    Raises:
        ValueError: names the first replica whose stage tensors differ and both rows' counts and bytes. The
            agreement at construction compares the persistent tensors' names and shapes only: a dtype (one rank's
            buffer in float64) or a non-persistent buffer's shape could differ, and a broadcast of another size
            is undefined (gloo aborted the process with signal 6, or filled a larger buffer in part without a
            word; NCCL may hang or corrupt memory).
    """
    for replica, row in enumerate(rows):
        if row != rows[0]:
            raise ValueError(
                f"pipeline rank {grid.pp_rank}'s stage parameters and buffers differ between replicas: replica 0 has "
                f"{rows[0][0]} tensors of {rows[0][1]} bytes, replica {replica} {row[0]} tensors of {row[1]} bytes"
                f"{' (other dtypes or shapes)' if row[:2] == rows[0][:2] else ''}; build the same model, with the "
                f"same dtypes and buffers, on every rank before constructing the Pipeline")


@torch.no_grad()
def copy_replica_zero(stages: dict, dp_group, grid, device=None) -> None:
    """Collective over this rank's data-parallel group: overwrite this rank's stage parameters and buffers with
    replica 0's (the rank of the same pipeline rank in replica 0 sends). First one all-gather of every replica's
    :func:`layout` (on ``device``, the stages': NCCL needs CUDA tensors; None: the first tensor's, else the CPU),
    refused on every replica alike where they differ (:func:`check_layouts`); then one broadcast per bucket, the
    same buckets on every replica."""
    source = grid.pp_rank  # world rank of pipeline rank pp_rank in replica 0
    tensors = replica_tensors(stages)
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    check_layouts(gather_rows(layout(tensors), dp_group, grid.dp_size, torch.int64, device, COPY_WHAT), grid)
    for bucket in buckets(tensors):
        # raw bytes both ways (same-size integer views): torch has no cat/copy for some dtypes (int1..uint7 on CPU)
        flat = torch.cat([as_bytes(t) for t in bucket])
        dist.broadcast(flat, src=source, group=dp_group)
        if grid.dp_rank == 0:
            continue
        offset = 0
        for tensor in bucket:
            n = tensor.numel() * tensor.element_size()
            _raw(tensor).copy_(flat[offset:offset + n].view(_raw(tensor).dtype).view(tensor.shape))
            offset += n


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a same-size integer view (written in place like it), as :func:`wire.as_bytes` reads it; a
    conjugate or negative view as itself (its storage does not hold its values)."""
    integer = SAME_SIZE_INT.get(tensor.element_size())
    if integer is None or tensor.is_conj() or tensor.is_neg():
        return tensor
    return tensor.view(integer)
