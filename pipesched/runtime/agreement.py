"""Before any process group of a Pipeline exists: every rank of the job checks that all ranks built the same
pipeline, through the default group's store, so a mismatch (another schedule, ``dp_size``, ``balance``, ...)
or a rank that refused its arguments is a clear error on every rank instead of a collective that waits
until the timeout.

Each rank publishes, under the number of Pipelines it has constructed so far (counted in the store, so
equal on every rank that constructs the same Pipelines in the same order), either a description of its
pipeline or the error it raised; then it reads every rank's entry and compares. A rank that comes to its round
after the others gave up on it (late by more than ``timeout``) raises ``TimeoutError`` naming them
(:mod:`~pipesched.runtime.exchange`'s rounds).
"""
from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

from ..ir import Op
from ..program_io import fingerprint
from .comm import groups_error_key, init_default_group, timeout_ok
from .exchange import publish, read_all
from .failure import FailureRecord, PipelineError
from .failure import describe as describe_error
from .model_difference import difference, publish_spec

_PREFIX = "pipesched/construct"
_JOIN_TO_REFUSE_S = 30.0  # refuse_construction's longest wait in the rendezvous
_POLL_S = 0.05  # groups_failed's pause between two looks at its round's entries
_CONNECTED = "pipesched/connected"  # the round after every rank created its Pipeline's process groups
_LATE_CONNECTED = "finish creating their Pipeline's process groups within {timeout} s"
_LATE = ("construct their Pipeline within {timeout} s; every rank must construct the same Pipelines in the same "
         "order")


def describe(program, balance, num_layers: int, world_size: int, early_receives: int = 0) -> dict:
    """What every rank of the job must agree on, JSON-ready, most telling field first (each named after the
    ``Pipeline`` argument it comes from, so a mismatch names the argument and both values; the program's
    fingerprint last, for what no argument explains).

    Args:
        program: the program ``step()`` runs once the message shapes are known (``Pipeline.program``).
        early_receives: how many instructions early that program posts receives (``StepPrograms.early_receives``;
            0: program order), reported as the ``early_receives`` argument it follows from.
    """
    recomputed = program.stages_with(Op.R)
    early = (f"True (receives posted up to {early_receives} instructions early)" if early_receives else
             "False (every message at its program position)")
    return {"world_size": world_size, "dp_size": program.dp_size, "schedule": program.schedule,
            "num_microbatches": program.num_microbatches, "stages": program.num_stages,
            "recompute": [s in recomputed for s in range(program.num_stages)],
            "split_backward stages": sorted(program.stages_with(Op.I)), "layers": num_layers,
            "balance": list(balance), "early_receives": early,
            "program fingerprint": f"{fingerprint(program):014x}"}


def model_shapes(state_spec: dict) -> str:
    """The ``model`` field every rank agrees on: how many tensors the unsplit model's ``state_dict()`` has and a
    digest of their names and shapes (``Pipeline.state_spec``), so that a model of other widths on one rank (same
    layer count, other ``Linear`` sizes) is refused at construction on every rank, not at a step's first message."""
    digest = hashlib.blake2b(repr(sorted(state_spec.items())).encode(), digest_size=6).hexdigest()
    return f"{len(state_spec)} tensors, names and shapes digest {digest}"


def agree(store, world_rank: int, world_size: int, description: dict, timeout: float, spec: dict | None = None) -> int:
    """Publish this rank's ``description`` (JSON-ready) and check every rank published the same one. Returns the
    round's number (1 for the job's first Pipeline construction, refused ones counted): the same on every rank for
    one Pipeline, and another for each other Pipeline (the checkpoint votes compare it).

    Raises:
        ValueError: a rank refused its arguments (names it and quotes its error), or a rank described another
            pipeline (names the first differing field, both ranks and both values; for ``model``, also the first
            tensor whose name or shape differs, from each rank's ``spec``: {name: shape}, read on this path only).
        TimeoutError: some ranks published nothing within ``timeout`` seconds (names them); or this rank came
            to its round after the others had timed out and given up on it (names them; it does not go on alone
            into the process groups' creation: :mod:`~pipesched.runtime.exchange`).
    """
    key = publish(store, _PREFIX, world_rank, {"description": description})
    entries = read_all(store, key, world_rank, world_size, timeout, _LATE)
    for rank, entry in enumerate(entries):
        if "error" in entry:
            raise ValueError(f"world rank {rank} refused its Pipeline arguments: {entry['error']}")
    models = {entry["description"].get("model") for entry in entries}
    if spec is not None and len(models) > 1:  # every rank sees it: each files its tensors for the error's detail
        publish_spec(store, key, world_rank, spec)
    for rank, entry in enumerate(entries):
        theirs = entry["description"]
        for field, mine in description.items():
            if theirs.get(field) != mine:
                detail = difference(store, key, world_rank, rank, spec, timeout) if field == "model" and spec else ""
                if field == "program fingerprint":  # every argument agreed: the program itself differs
                    detail = (" (the schedule, sizes and options agree: the schedule's builder gave these ranks "
                              "other instructions, so it must not depend on random draws, the time or the rank; or the "
                              "Program passed as schedule= differs between them)")
                raise ValueError(f"world rank {rank} built its Pipeline with {field}={theirs.get(field)!r} but world "
                                 f"rank {world_rank} with {field}={mine!r}{detail}; every rank must construct "
                                 f"Pipeline with the same arguments (and the same model)")
    return int(key.rsplit("/", 1)[1])


def connected(store, world_rank: int, world_size: int, timeout: float) -> None:
    """Once this rank has created every process group of its Pipeline: wait until every rank has, so that no rank
    returns from construction, and can ``close()`` (destroy) its groups, while a peer is still connecting them
    (gloo's creation on that peer failed with "Connection closed by peer" when a rank closed right after
    constructing). One store round, no collective.

    Raises:
        TimeoutError: some ranks did not finish creating their groups within ``timeout`` seconds (names them).
        PipelineError: a rank's creation of these groups failed (:func:`~pipesched.runtime.comm.make_groups`
            published it): at once, naming that rank (on NCCL the creation connects lazily, so this rank was not
            blocked in it and would otherwise wait out ``timeout``); or its entry says so (:func:`groups_failed`).
    """
    watch = groups_error_key(store, world_rank)
    key = publish(store, _CONNECTED, world_rank, True)
    entries = read_all(store, key, world_rank, world_size, timeout, _LATE_CONNECTED, watch=watch)
    failed = [rank for rank, entry in enumerate(entries) if entry is not True]
    if failed:  # its entry filed by groups_failed, after the record it published under ``watch``
        try:
            record = FailureRecord.from_json(store.get(watch).decode())
        except Exception:  # noqa: BLE001 - no record (cannot happen: published first): the entry says it
            raise RuntimeError(f"world rank {failed[0]} failed to create its Pipeline's process groups: "
                               f"{entries[failed[0]].get('error')}") from None
        raise PipelineError(record, world_rank, f"while waiting for every rank's entry in {key}")


def groups_failed(store, world_rank: int, world_size: int, timeout: float, error: BaseException) -> None:
    """File this rank's :func:`connected` entry (saying it failed) after its
    :func:`~pipesched.runtime.comm.make_groups` raised ``error``, instead of calling :func:`connected`, then wait
    (at most ``timeout`` seconds) until every rank has filed its own, failed or not.

    Filing: every rank that creates a Pipeline's groups files one entry, so the ranks' counters of the
    ``connected`` rounds stay in step (before, the failing rank filed none while a rank whose creation had returned
    filed one in :func:`connected`: at the job's next construction the failing rank met that stale entry and
    returned, while the other waited for it until ``timeout``). Waiting: a rank blocked in gloo's creation (waiting
    for this one to connect) fails only after ``timeout``; a failing rank that raised at once reached the next
    construction's agreement ``timeout`` before it and gave up on it there. So the ranks leave a failed
    construction together and the job's next Pipeline meets on every rank. A best-effort call: it never raises."""
    try:
        _await_round(store, publish(store, _CONNECTED, world_rank, {"error": describe_error(error)}), world_size,
                     timeout)
    except Exception:  # noqa: BLE001 - the local error is what the caller raises
        pass


def _await_round(store, key: str, world_size: int, timeout: float) -> None:
    """Wait until every world rank has filed its entry in round ``key``, at most ``timeout`` seconds."""
    keys = [f"{key}/{rank}" for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def refuse(store, world_rank: int, error: BaseException) -> str | None:
    """Publish that this rank's Pipeline construction failed with ``error``, so the other ranks' :func:`agree`
    raises at once; returns the round's key (``None`` if the store did not take it: it never raises itself)."""
    try:
        return publish(store, _PREFIX, world_rank, {"error": f"{type(error).__name__}: {error}"})
    except Exception:  # noqa: BLE001 - best effort: the local error is what the caller raises
        return None


def refuse_construction(error: Exception, timeout=None) -> None:
    """This rank's ``Pipeline(...)`` failed before any communication (``error``): file the refusal the other ranks'
    construction reads (:func:`refuse`), so they raise it instead of waiting for this rank until the timeout.

    Where no default process group is up yet but a launcher's environment is (torchrun, or ``MASTER_ADDR``,
    ``RANK`` and ``WORLD_SIZE`` set by hand), this rank first joins the default group's rendezvous, which the
    others wait in, for at most ``min(timeout, 30)`` seconds (``timeout``: the Pipeline's, 300 where it is not a
    valid number); a rank that never came would otherwise keep them there until their timeout. Having joined, it
    then waits (as long again at most) until every rank has filed its entry of the round, so that its exit, which
    may take the store with it (world rank 0 hosts it under a hand-set environment) or make torchrun stop the
    others, comes after they have the refusal to read. Never raises: the local error is what the caller raises."""
    if not dist.is_available():
        return
    joined, wait = False, min(_valid_timeout(timeout), _JOIN_TO_REFUSE_S)
    if not dist.is_initialized() and all(name in os.environ for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE")):
        try:  # gloo whatever the stages' device: this rank only files its refusal in the group's store
            init_default_group(torch.device("cpu"), wait)
        except Exception:  # noqa: BLE001 - the others did not come: they meet this rank's absence as before
            return
        joined = True
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        key = refuse(store, dist.get_rank(), error)
        if joined and key is not None:
            try:
                _await_round(store, key, dist.get_world_size(), wait)
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
                pass


def _valid_timeout(timeout) -> float:
    """``timeout`` as seconds where it is a valid Pipeline timeout (:func:`~.comm.timeout_ok`), else 300."""
    return float(timeout) if timeout_ok(timeout) else 300.0
