"""Tied parameters across pipeline ranks: find them, check their copies agree, give each tie its process group.

A *tied* parameter is one ``nn.Parameter`` used by layers of two or more stages (a GPT's token embedding and its
LM head: ``head.weight = embedding.weight``), trainable or frozen (it may be unfrozen later). The model is built
identically on every rank, so each rank holding a use keeps its own copy; the copies start identical
(:func:`check_copies`), their gradients are summed among exactly those ranks after the last backward of the step (the ``TIE_REDUCE`` of the program, :mod:`pipesched.ties`, run by
:class:`~pipesched.runtime.tie_reduce.TieReducer`), so the same optimizer step keeps them bitwise identical.
A parameter shared by stages of one rank only (interleaved placement) needs nothing: autograd sums both uses.
"""
from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..lower import add_tie_reduce
from ..ties import tie_ranks
from ..validate import validate
from .comm import backend_for
from .stage import stage_of_each_layer
from .state import rank_view
from .tie_reduce import TieReducer


class TiedParameter(NamedTuple):
    """One parameter used by two or more stages.

    Attributes:
        names: its names in the unsplit model (fully qualified: the layer's key in the model + name), one per
            use, in model order, e.g. ``("0.weight", "5.weight")``, ``("embed.weight", "head.weight")``.
        stages: the stages using it, sorted.
        ranks: the pipeline ranks holding those stages, sorted.
        owner: the stage that owns it (the first): a global norm or a checkpoint counts it on that stage's rank.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    owner: int

    @property
    def cross_rank(self) -> bool:
        """Whether its uses are on two ranks or more (then its gradients need a ``TIE_REDUCE``)."""
        return len(self.ranks) > 1


def find_ties(layers: Sequence[nn.Module], balance: Sequence[int], stage_to_rank,
              names=None) -> tuple[TiedParameter, ...]:
    """Every parameter used by two stages or more, in the order of its first use.

    Args:
        layers: the model's layers, in order. balance: layers per stage. stage_to_rank: pipeline rank per stage.
        names: each layer's key in the model (:func:`~pipesched.runtime.stage.layer_names`); ``None``: its index.
    Sharing is identity: a frozen parameter (``requires_grad=False``) is a tie too, since it may be unfrozen later
    (its copies must then be summed, and they must be identical now); buffers are not ties (nothing sums them).
    Another tensor over a parameter's memory (a view or slice that is not the same ``Parameter``, a buffer over a
    weight) with uses on two ranks is no tie: :func:`~pipesched.runtime.shared_buffers.shared_buffers` refuses it.
    """
    uses: dict[int, list[tuple[str, int]]] = {}  # id(parameter) -> [(name, stage)] in model order
    for stage, index in stage_of_each_layer(balance):
        for name, tensor in layers[index].named_parameters(remove_duplicate=False):
            key = str(index) if names is None else names[index]
            uses.setdefault(id(tensor), []).append((f"{key}.{name}", stage))
    ties = []
    for found in uses.values():
        stages = tuple(sorted({stage for _, stage in found}))
        if len(stages) > 1:
            ranks = tuple(sorted({stage_to_rank[s] for s in stages}))
            ties.append(TiedParameter(tuple(dict.fromkeys(n for n, _ in found)), stages, ranks, stages[0]))
    return tuple(ties)


def program_ties(ties: Sequence[TiedParameter]) -> tuple[tuple[int, ...], ...]:
    """The tie groups a program needs (:attr:`pipesched.ir.Program.ties`): the stages of each cross-rank tie,
    each group once (two parameters shared by the same stages are summed by one collective)."""
    return tuple(dict.fromkeys(t.stages for t in ties if t.cross_rank))


def parameter_of(layers: Sequence[nn.Module], name: str, names=None) -> nn.Parameter:
    """The parameter called ``name`` (``"5.weight"``, ``"embed.weight"``) in the unsplit model made of ``layers``,
    whose keys are ``names`` (``None``: the indices); a key holds no dot, so ``name`` up to its first is the layer's."""
    key, _, rest = name.partition(".")
    return layers[int(key) if names is None else list(names).index(key)].get_parameter(rest)


def tied_params(layers, ties: Sequence[TiedParameter], groups: Sequence[tuple[int, ...]], pp_rank: int,
                names=None) -> dict:
    """{number of a program tie group this rank holds: [this rank's copies of its parameters]}."""
    out: dict[int, list] = {}
    for k, stages in enumerate(groups):
        mine = [parameter_of(layers, t.names[0], names) for t in ties if t.stages == stages and pp_rank in t.ranks]
        if mine:
            out[k] = mine
    return out


def counted_parameters(stages: dict, first_layers, ties: Sequence[TiedParameter], stage_to_rank, pp_rank: int,
                       names=None):
    """This rank's parameters that a global norm or a checkpoint counts once over the pipeline: every parameter of
    its ``stages`` ({stage: nn.Sequential of its layers}, the first being layer ``first_layers[stage]`` of the
    model, whose layers' keys are ``names``), each once, except tied copies whose owning stage is on another rank."""
    view = rank_view(stages, first_layers, names)  # this rank's layers under the unsplit model's names
    local = {name for name, _ in view.named_parameters(remove_duplicate=False)}
    elsewhere = {id(view.get_parameter(name)) for t in ties if stage_to_rank[t.owner] != pp_rank
                 for name in t.names if name in local}
    seen = set()
    for module in stages.values():
        for p in module.parameters():
            if id(p) not in seen and id(p) not in elsewhere:
                seen.add(id(p))
                yield p


def digest(tensor: torch.Tensor) -> str:
    """A checksum of ``tensor``'s dtype, shape and bytes (equal exactly when the values are bitwise equal)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    return hashlib.blake2b(head + data, digest_size=16).hexdigest()


def check_copies(layers, ties: Sequence[TiedParameter], grid, names=None) -> None:
    """Collective over the default group (every world rank): each rank's copy of each cross-rank tied parameter it
    holds must equal the other copies of its replica bit for bit (replicas may differ: every replica then gets
    replica 0's, :mod:`~pipesched.runtime.replica_init`). Every rank reaches the same verdict.

    Raises:
        ValueError: on every rank, for the first tie whose copies differ: names the parameter (its names in the
            unsplit model), the world and pipeline ranks whose copies differ, and what to do.
    """
    ties = [t for t in ties if t.cross_rank]
    if not ties or grid.world_size == 1:
        return
    mine = {k: digest(parameter_of(layers, t.names[0], names)) for k, t in enumerate(ties)
            if grid.pp_rank in t.ranks}
    every: list = [None] * grid.world_size
    dist.all_gather_object(every, mine)
    for k, tie in enumerate(ties):
        # within each replica: replica 0's values are then copied to every replica (replica_init.py)
        pairs = []
        for replica in range(grid.dp_size):
            holders = [(rank, sums[k]) for rank, sums in enumerate(every)
                       if k in sums and rank // grid.pp_size == replica]
            pairs += [(holders[0][0], rank) for rank, value in holders if value != holders[0][1]]
        if pairs:
            first, other = pairs[0]
            raise ValueError(
                f"tied parameter {' = '.join(tie.names)} (stages {list(tie.stages)}) has different values on world "
                f"rank {first} (pipeline rank {first % grid.pp_size}) and world rank {other} (pipeline rank "
                f"{other % grid.pp_size}); its copies must be identical at construction: build the model the same "
                f"way on every rank (same seed, same initialisation) before Pipeline(...)")


def make_tie_groups(groups: Sequence[tuple[int, ...]], stage_to_rank, grid, timeout: float, backend: str) -> dict:
    """One process group per program tie group: the world ranks of the tie's pipeline ranks in every replica (so
    one sum gives the sum over uses and over replicas). Collective over the world (every rank creates every group,
    in tie order). Returns {tie number: group} for the ties this rank holds."""
    delta = datetime.timedelta(seconds=timeout)
    out = {}
    for k, stages in enumerate(groups):
        pp_ranks = sorted({stage_to_rank[s] for s in stages})
        world = [replica * grid.pp_size + r for replica in range(grid.dp_size) for r in pp_ranks]
        group = dist.new_group(world, timeout=delta, backend=backend)
        if grid.pp_rank in pp_ranks:
            out[k] = group
    return out


def with_ties(program, ties: Sequence[TiedParameter]):
    """``program`` (as :func:`~pipesched.api.compile_program` returns it) with the cross-rank ``ties`` added by
    :func:`~pipesched.lower.add_tie_reduce` and validated; ``program`` itself when no tie spans two ranks."""
    groups = program_ties(ties)
    return validate(add_tie_reduce(program, groups)) if groups else program


def start_ties(layers, ties: Sequence[TiedParameter], program, grid, timeout: float, device, names=None):
    """At construction, collective over the world: check the copies agree (:func:`check_copies`), then make the
    tie groups (:func:`make_tie_groups`). Returns ``({tie number: group} for this rank's ties, the TieReducer of
    this rank or None when it holds no cross-rank tie)``. Raises as :func:`check_copies`. ``names``: each layer's
    key in the model (``Pipeline.layer_names``; ``None``: its index)."""
    check_copies(layers, ties, grid, names)
    groups = make_tie_groups(program.ties, program.stage_to_rank, grid, timeout, backend_for(device))
    if not groups:
        return groups, None
    keeps = {k for k in groups if grid.pp_rank == tie_ranks(program, k)[0]}  # TieReducer.begin
    return groups, TieReducer(tied_params(layers, ties, program.ties, grid.pp_rank, names), groups, grid.dp_size,
                              keeps)
