"""Process groups: the PP x DP grid, the default group (torchrun's or a 1-process one), the no-launcher warning.

Rank layout: with ``p`` pipeline ranks and ``d = dp_size`` replicas, world rank ``g`` is pipeline rank
``g % p`` of replica ``g // p``. Replica ``k``'s pipeline is world ranks ``k*p .. k*p + p - 1``; the
data-parallel group of pipeline rank ``r`` is world ranks ``r, r + p, ..., r + (d-1)*p``.

Messages between the ranks: :mod:`pipesched.runtime.wire`.
"""
from __future__ import annotations

import datetime
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checks import is_real
from .elastic import attempt_store
from .groups_failure import COUNT_KEY, ERROR_KEY, creation_failure


MAX_TIMEOUT_S = 1e9  # seconds (~31 years): gloo keeps a timeout in int64 nanoseconds (overflows near 9.2e9 s)


def timeout_ok(timeout) -> bool:
    """Whether ``timeout`` is a valid ``Pipeline`` timeout: a number of seconds (not a bool) > 0 and at most
    :data:`MAX_TIMEOUT_S`."""
    return is_real(timeout) and 0 < timeout <= MAX_TIMEOUT_S

@dataclass(frozen=True)
class Grid:
    """Where this process sits in the PP x DP grid (see the module docstring for the layout)."""

    world_rank: int
    world_size: int
    pp_size: int
    dp_size: int

    @property
    def pp_rank(self) -> int:
        return self.world_rank % self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.world_rank // self.pp_size

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """World ranks of replica ``replica``'s pipeline, by pipeline rank."""
        return tuple(replica * self.pp_size + r for r in range(self.pp_size))

    def dp_ranks(self, pp_rank: int) -> tuple[int, ...]:
        """World ranks of the data-parallel group of pipeline rank ``pp_rank``."""
        return tuple(k * self.pp_size + pp_rank for k in range(self.dp_size))


def make_grid(world_rank: int, world_size: int, dp_size: int) -> Grid:
    """The grid for ``world_size`` processes and ``dp_size`` replicas.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``dp_size`` (names both).
    """
    if world_size % dp_size:
        raise ValueError(f"dp_size={dp_size} does not divide the world size {world_size}; "
                         f"world size = pipeline ranks x dp_size")
    return Grid(world_rank, world_size, world_size // dp_size, dp_size)


def world_and_rank() -> tuple[int, int]:
    """(world size, rank) from the default group, or from torchrun's environment, or (1, 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class SingleProcessWarning(UserWarning):
    """A ``Pipeline`` built where nothing launched other ranks: it has one rank and splits nothing."""


def warn_if_unlaunched() -> None:
    """Warn (:class:`SingleProcessWarning`) when no launcher started this process: no default process group is
    initialized and ``WORLD_SIZE`` is not in the environment (``python train.py`` without torchrun), so the pipeline
    gets one rank and the whole model runs here. Silent under torchrun or :func:`~pipesched.runtime.launch` (even
    with one process) and when the caller initialized a default group itself (one process on purpose); once a
    ``Pipeline`` has created its own default group, later ones in the process are silent too. The warning points
    at the first frame outside pipesched: the caller's ``Pipeline(...)`` line, however many of pipesched's own
    frames (a decorator, a subclass's ``super().__init__``) lie between."""
    if (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ:
        return
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    warnings.warn(
        "pipesched: no launcher started this process (no torch.distributed process group is initialized and "
        "WORLD_SIZE is not set), so this Pipeline has 1 rank and splits nothing: the whole model runs in this one "
        f"process. To pipeline it over N processes, launch them: `torchrun --nproc-per-node N {script}`, or from "
        "Python `pipesched.runtime.launch(fn, N)`. To run one process on purpose without this warning, call "
        "torch.distributed.init_process_group first (or use torchrun --nproc-per-node 1).",
        SingleProcessWarning, stacklevel=outside_pipesched())


def outside_pipesched() -> int:
    """The ``stacklevel`` of the caller's first frame outside the pipesched package, as seen from a function of
    pipesched that calls ``warnings.warn`` and then this (1: that function itself)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1  # the function that warns (stacklevel 1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def init_default_group(device: torch.device, timeout: float = 300.0) -> None:
    """Create the default process group if there is none: env:// under torchrun, else a 1-process group.

    Raises:
        TimeoutError: under env://, the other ranks did not join within ``timeout`` seconds (names ``WORLD_SIZE``,
            the address and how to start every rank).
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not ("MASTER_ADDR" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    try:
        store = attempt_store(timeout)  # torchrun's agent store: a key space per restart (runtime/elastic.py)
        given = {} if store is None else dict(store=store, rank=int(os.environ["RANK"]),
                                              world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **given)
    except (dist.DistStoreError, dist.DistNetworkError) as exc:
        env = os.environ
        raise TimeoutError(
            f"rank {env['RANK']} of WORLD_SIZE={env['WORLD_SIZE']}: the other ranks did not join at "
            f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '?')} within timeout={timeout:g} s "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}); start every rank (e.g. torchrun "
            f"--nproc-per-node {env['WORLD_SIZE']} train.py), or unset WORLD_SIZE, RANK and MASTER_ADDR to run "
            f"one process") from None


def backend_for(device: torch.device) -> str:
    """The backend of the pipeline and data-parallel groups of stages on ``device``: NCCL on CUDA, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


def make_groups(grid: Grid, timeout: float, device: torch.device):
    """Create every replica's pipeline group and every pipeline rank's DP group (collective over the world,
    same order on every rank); return ``(my_pp_group, my_dp_group or None)``. Their backend follows the
    device the stages live on (NCCL for CUDA, gloo otherwise), whatever the default group's is. Waits on
    them time out after ``timeout`` seconds.

    Raises:
        PipelineError: the creation failed on some rank, on every rank
            (:func:`~pipesched.runtime.groups_failure.creation_failure`): the rank that
            failed first is named with its exception, on that rank at once, on the others (blocked in the
            creation) when their wait ends, after ``timeout``; where no rank published a failure, the ranks that
            never began this creation (their count in the store is behind), else, after a
            timeout, the ranks that did not answer the roll call (stalled inside it), else
            this rank's timeout, saying what it waited for and ``timeout``.
    """
    store = dist.distributed_c10d._get_default_store()
    attempt = store.add(COUNT_KEY.format(rank=grid.world_rank), 1)  # this rank's n-th meets the others' n-th
    try:
        return _new_groups(grid, timeout, device)
    except Exception as exc:  # noqa: BLE001 - every rank must learn who failed
        raise creation_failure(store, attempt, grid, timeout, exc) from exc


def groups_error_key(store, world_rank: int) -> str:
    """The key under which this rank's latest :func:`make_groups` (its n-th, meeting every rank's n-th) has its
    failure published by any rank (:func:`~pipesched.runtime.groups_failure.creation_failure`): what
    :func:`~pipesched.runtime.agreement.connected`
    watches (on NCCL, ``dist.new_group`` connects lazily: the others are not blocked in the creation)."""
    return ERROR_KEY.format(attempt=store.add(COUNT_KEY.format(rank=world_rank), 0))


def _new_groups(grid: Grid, timeout: float, device: torch.device):
    delta = datetime.timedelta(seconds=timeout)
    backend = backend_for(device)
    pp_group = dp_group = None
    for k in range(grid.dp_size):
        group = dist.new_group(list(grid.pipeline_ranks(k)), timeout=delta, backend=backend)
        if k == grid.dp_rank:
            pp_group = group
    if grid.dp_size > 1:
        for r in range(grid.pp_size):
            group = dist.new_group(list(grid.dp_ranks(r)), timeout=delta, backend=backend)
            if r == grid.pp_rank:
                dp_group = group
    return pp_group, dp_group
