"""Data-parallel replicas must hold the same parameters; a save checks that they still do.

The replicas of one pipeline rank start equal (the Pipeline's construction) and stay equal only while every replica
applies the same update: ``optimizer.step()`` skipped on one rank, another learning rate there, or a parameter
changed by hand leaves them apart with no error, and a checkpoint would then keep whichever replica's values DCP
wrote. :func:`save_checkpoint <pipesched.runtime.checkpoint.save_checkpoint>` puts each rank's
:func:`parameter_digests` in its vote on the arguments, and :func:`check_replicas_agree` refuses the save on every
rank, naming the replicas and the first parameter that differs, before anything is written.

A digest is a position-weighted sum of the parameter's bits (:func:`digest`: its bytes read as 32-, 16- or 8-bit
words, word ``k`` times ``2k + 1``, summed modulo 2**64): a change to any one word changes it, and so, but for
rare coincidences, do permutations and sign flips (an XOR such as ``torch.hash_tensor``'s cancels those); it
works for every dtype (complex and float8 included), is the same on CPU and CUDA (modular sums do not depend on
their order), and costs a few passes over each parameter, in chunks of at most 2**22 words.
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
    params = list(pipe.parameters())  # each once
    return {"pp_rank": grid.pp_rank, "dp_rank": grid.dp_rank,
            "names": [names.get(id(p), "?") for p in params], "digests": [digest(p) for p in params]}


_CHUNK = 1 << 22  # words per pass: bounds the int64 scratch at 32 MiB whatever the parameter's size
_MASK = (1 << 64) - 1


def digest(tensor: torch.Tensor) -> int:
    """``sum_k word_k * (2k + 1) mod 2**64`` over ``tensor``'s bytes read as the widest of int32, int16, uint8
    words that divides them (any dtype; an empty tensor: 0). Odd weights: changing any one word changes the sum."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    size = next(n for n in (4, 2, 1) if raw.numel() % n == 0)
    words = raw.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[size])
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device).mul_(2).add_(1)
        total += int(chunk.mul_(weights).sum())  # int64 arithmetic wraps: the sum modulo 2**64, in any order
    return total & _MASK


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
