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

import itertools

import torch
import torch.distributed as dist

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


@torch.no_grad()
def copy_replica_zero(stages: dict, dp_group, grid) -> None:
    """Collective over this rank's data-parallel group: overwrite this rank's stage parameters and buffers with
    replica 0's (the rank of the same pipeline rank in replica 0 sends). One broadcast per bucket; the same
    buckets on every replica (the model's names and shapes are agreed at construction)."""
    source = grid.pp_rank  # world rank of pipeline rank pp_rank in replica 0
    for bucket in buckets(replica_tensors(stages)):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat.view(torch.uint8), src=source, group=dp_group)
        if grid.dp_rank == 0:
            continue
        offset = 0
        for tensor in bucket:
            n = tensor.numel()
            tensor.copy_(flat[offset:offset + n].view_as(tensor))
            offset += n
