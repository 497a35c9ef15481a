"""Data-parallel replicas must hold the same parameters; a save checks that they still do.

The replicas of one pipeline rank start equal (the Pipeline's construction) and stay equal only while every replica
applies the same update: ``optimizer.step()`` skipped on one rank, another learning rate there, or a parameter
changed by hand leaves them apart with no error, and a checkpoint would then keep whichever replica's values DCP
wrote. :func:`save_checkpoint <pipesched.runtime.checkpoint.save_checkpoint>` puts each rank's
:func:`parameter_digests` in its vote on the arguments, and :func:`check_replicas_agree` refuses the save on every
rank, naming the replicas and the first parameter that differs, before anything is written.

A digest is ``torch.hash_tensor`` of the parameter's bits (an XOR over its 64-bit words): any change to one value
changes it; it costs one read of each parameter.
"""
from __future__ import annotations

import torch

from .state import parameter_names


def parameter_digests(pipe) -> dict | None:
    """``{"pp_rank", "dp_rank", "names": [...], "digests": [...]}`` of this rank's parameters in model order (a
    parameter used twice once), or ``None`` without data parallelism (``dp_size == 1``: nothing to compare)."""
    grid = pipe.grid
    if grid.dp_size == 1:
        return None
    names = parameter_names(pipe)
    params = list({id(p): p for p in pipe.parameters()}.values())
    hashes = [torch.hash_tensor(p.detach()) if p.numel() else torch.zeros((), dtype=torch.uint64, device=p.device)
              for p in params]
    digests = torch.stack(hashes).tolist() if hashes else []  # one copy to the host (a sync on CUDA)
    return {"pp_rank": grid.pp_rank, "dp_rank": grid.dp_rank,
            "names": [names.get(id(p), "?") for p in params], "digests": [int(d) for d in digests]}


def check_replicas_agree(oks: list, call: str) -> None:
    """Refuse ``call`` where two replicas of one pipeline rank hold different parameters: ``oks[r]["replica"]`` is
    world rank ``r``'s :func:`parameter_digests`.

    Raises:
        ValueError: ``"save_checkpoint: the data-parallel replicas hold different parameters: world rank 0 (replica
            0 of pipeline rank 0) and world rank 2 (replica 1) differ first in 'layers.0.weight' (2 of 4 parameters
            differ); ..."``, the same on every rank.
    """
    first: dict = {}
    for world, ok in enumerate(oks):
        mine = ok.get("replica")
        if mine is None:
            continue
        pp = mine["pp_rank"]
        if pp not in first:
            first[pp] = (world, mine)
            continue
        base_world, base = first[pp]
        if base["digests"] != mine["digests"] or base["names"] != mine["names"]:
            raise ValueError(_drift_text(call, base_world, base, world, mine))


def _drift_text(call: str, world_a: int, a: dict, world_b: int, b: dict) -> str:
    pairs = list(zip(a["names"], a["digests"], b["digests"]))
    differ = [name for name, x, y in pairs if x != y] or ["(the parameter lists differ)"]
    return (f"{call}: the data-parallel replicas hold different parameters: world rank {world_a} (replica "
            f"{a['dp_rank']} of pipeline rank {a['pp_rank']}) and world rank {world_b} (replica {b['dp_rank']}) "
            f"differ first in {differ[0]!r} ({len(differ)} of {len(pairs)} parameters differ); replicas stay equal "
            f"only if every rank applies the same update (optimizer.step() and zero_grad() on every rank, the same "
            f"optimizer settings, no parameter changed on one rank alone), so training has already diverged; "
            f"nothing was written")
