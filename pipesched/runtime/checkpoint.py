"""Checkpoints of a pipelined model with ``torch.distributed.checkpoint`` (DCP): sharded, atomic, reshardable.

A checkpoint is a DCP directory (``.metadata`` plus one ``__<rank>_0.distcp`` file per writing rank) holding:

- ``model.<fqn>``: every parameter and persistent buffer under the unsplit ``nn.Sequential``'s names
  (:func:`~pipesched.runtime.state.saved_state`), so it does not depend on ranks, virtual stages, balance or schedule;
  a data-parallel replica's copies are written once (DCP deduplicates equal names).
- ``optim.<key>``: optimizer state keyed by parameter name (:mod:`~pipesched.runtime.optim_state`), if given.
- ``rng.<world rank>.<generator>``: each rank's torch CPU (and CUDA) generator, Python ``random`` and NumPy states.
- ``pipesched.*`` and ``extra.*``: the format tag, ``step``, the layout it was saved from and the user's ``extra``.

Each rank writes its own file, in parallel, into a temporary directory next to the target
(``.<name>.saving``); after every rank has finished (DCP's final gather writes ``.metadata``, then a vote of all
ranks), world rank 0 renames it to the target. A save that dies half-way leaves only that hidden directory,
which :func:`load_checkpoint` refuses and :func:`latest_checkpoint` skips.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..checks import as_int, check_flag, described
from . import rng_state
from .optim_state import load_flat_state
from .state import first_mismatch, parameter_names, pipe_read_plan, read_plan, shared_aliases
from .checkpoint_read import (SAVING, as_path, copy_in, empty_for, extra_of, firsts, hidden, optimizer_keys,
                              read_checkpoint, read_locally, shape_of, staging_for)
from .vote import Verdict, check_optimizers, check_same, vote
from .misfit import refused_on_misfit
from .replica_drift import check_replicas_agree, parameter_digests
from .checkpoint_group import checkpoint_group
from .checkpoint_write import (check_save, commit, extra_summary, failures_named, lost_peer_named, named_failure,
                               state_to_save)



@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` (or :func:`load_into`) read besides the tensors.

    Attributes:
        step: the ``step`` given to :func:`save_checkpoint` (an int, or ``None``).
        extra: the ``extra`` given to it (the same on every rank), as JSON gives it back (tuples come back as
            lists), with its tensors (top-level values of a dict) as CPU tensors.
        rng_restored: whether this rank's random generators were set to those saved by the same world rank (only
            when the checkpoint was saved with the same pipeline ranks and ``dp_size``).
    """

    step: int | None
    extra: object = None
    rng_restored: bool = False


@refused_on_misfit(lambda pipe, error: _refuse_misfit("save_checkpoint", pipe, error),
                   owner=lambda args, kwargs: _pipe_of(args, kwargs))
def save_checkpoint(path, pipe, optimizer=None, step: int | None = None, extra=None) -> str:
    """Save ``pipe``'s model (and ``optimizer``'s state, every rank's RNG state, ``step``, ``extra``) to directory
    ``path``; collective: call it on every rank of the job with the same ``path`` and ``step``, and an optimizer on
    every rank or on none (a rank whose stages hold no parameters passes ``None`` either way).

    Every rank checks its arguments and collects what it will write, then all ranks vote (a bad argument, or a
    failure collecting the state, on one rank is the same error on every rank, before anything is written); each
    rank writes its own shard file in parallel into a hidden temporary
    directory next to ``path``, and world rank 0 renames it to ``path`` once every rank has finished. An existing
    checkpoint at ``path`` is replaced; anything else there is refused. ``path`` must be on a filesystem that every
    rank sees (as DCP's ``FileSystemWriter`` needs).

    Args:
        path: the checkpoint directory to create (str or ``os.PathLike``), e.g. ``"ckpt/step-000100"``.
        pipe: the :class:`~pipesched.runtime.Pipeline`.
        optimizer: ``None``, or a ``torch.optim.Optimizer`` over this rank's parameters (``pipe.parameters()``);
            ``None`` on a rank whose stages hold no parameters while the others pass theirs.
        step: ``None`` or an int >= 0, returned by :func:`load_checkpoint` (and ordering :func:`latest_checkpoint`).
        extra: ``None``, a JSON-serialisable value (dict, list, str, int, float, bool, None), or a dict whose
            top-level values may also be tensors (saved with DCP); the same on every rank (compared in the vote:
            JSON with sorted keys, tensors by dtype, shape and a digest of their bytes), since the checkpoint keeps
            one and :func:`load_checkpoint` gives it to every rank.
    Returns:
        ``path`` as an absolute path.
    Raises:
        TypeError, ValueError: a bad argument (names it, its value and what is valid; ``pipe`` not a Pipeline
            included), ranks that give different
            ``path``, ``step`` or ``extra`` (names both ranks and values; a long ``extra`` cut, with a digest), or
            different Pipelines (rank-dependent code saving
            ``pipe_a`` on one rank and ``pipe_b`` on another: names both ranks and each one's Pipeline, which says
            which of the job's Pipelines it is), an optimizer on some ranks and ``None`` on a rank
            that holds parameters (names both ranks), an optimizer holding another rank's parameters, or
            data-parallel replicas whose parameters differ (:mod:`~pipesched.runtime.replica_drift`: names both
            world ranks and the first parameter that differs; nothing is written). Every
            rank that refused its arguments raises the first refusing rank's error; a rank that refused nothing
            raises it named: ``save_checkpoint: world rank R refused its arguments: <its message>``.
        ValueError: the ranks are in different checkpoint calls (``the ranks are in different checkpoint calls:
            world rank 0 is in save_checkpoint (...), world rank 1 in load_checkpoint (...)``), on every rank.
        FileExistsError: ``path`` exists and is not a pipesched checkpoint (it is left alone).
        TimeoutError: a rank did not reach the save within ``pipe.timeout`` seconds (names it); or, on a rank that
            reaches the save after the others gave up waiting for it, naming them (it does not go on alone).
        RuntimeError: a rank failed while collecting its state (``save_checkpoint: world rank R failed while
            collecting its state to save: <its error>``; e.g. an optimizer whose ``state_dict()`` refuses) or while
            writing (DCP's ``CheckpointException``, naming each failed rank and its error), raised on every rank;
            ``path`` is untouched. A rank that dies outside DCP's collectives makes the votes time out after
            ``pipe.timeout``.
        PipelineError: a rank's process ended inside DCP's collectives (killed while writing): named as lost, as in
            a step (``... was lost: its process ended ...``); or it stalled there: the others' wait times out after
            ``pipe.timeout`` (DCP runs on the Pipeline's group with that timeout,
            :mod:`~pipesched.runtime.checkpoint_group`) and names it, as a step's timeout does (``... did not time
            out within 1 s of this rank ...``); ``pipe`` is unusable afterwards. Also from :func:`load_checkpoint`.
    """
    rank = dist.get_rank()
    target = None
    try:
        _check_pipe(pipe)
        target = check_save(path, pipe, optimizer, step, extra, rank)
        step = None if step is None else as_int(step)  # a numpy integer: a plain int in the vote and the metadata
        state = named_failure(lambda: state_to_save(pipe, optimizer, step, extra, rank), "save_checkpoint", rank,
                               "collecting its state to save")  # before the vote: its error is every rank's
        verdict = Verdict(ok={"path": target, "step": step, "pipeline": _which(pipe), "extra": extra_summary(extra),
                              "replica": parameter_digests(pipe), **_optimizer_given(pipe, optimizer)})
    except Exception as exc:  # noqa: BLE001 - every rank must learn it
        verdict = Verdict(error=exc)
    try:
        oks = vote("save_checkpoint", "arguments", verdict, _timeout_of(pipe), pipe)
        for field in ("path", "step", "pipeline"):
            check_same(oks, field, "save_checkpoint")
        _check_same_extra(oks)
        check_optimizers(oks, "save_checkpoint")
        check_replicas_agree(oks, "save_checkpoint")
    except Exception:
        if rank == 0 and target is not None:  # refused: remove the temporary directory rank 0 made
            shutil.rmtree(hidden(target, SAVING), ignore_errors=True)
        raise
    target = oks[0]["path"]
    temp = hidden(target, SAVING)
    group = checkpoint_group(pipe)  # after the vote, on every rank alike: DCP waits at most pipe.timeout on it
    with failures_named(target, "writing"), lost_peer_named(pipe, target, "writing"):  # lost or stalled: named
        dcp.save(state, checkpoint_id=temp, process_group=group)
    vote("save_checkpoint", "written", Verdict(ok=True), pipe.timeout, pipe)  # every rank has finished writing
    error = None
    if rank == 0:
        try:
            commit(temp, target)
        except Exception as exc:  # noqa: BLE001 - every rank must learn it
            error = exc
    vote("save_checkpoint", "commit", Verdict(ok=True, error=error), pipe.timeout, pipe)
    return target


@refused_on_misfit(lambda pipe, error: _refuse_misfit("load_checkpoint", pipe, error),
                   owner=lambda args, kwargs: _pipe_of(args, kwargs))
def load_checkpoint(path, pipe, optimizer=None) -> CheckpointInfo:
    """Load a checkpoint of :func:`save_checkpoint` into ``pipe`` (and ``optimizer``); collective: call it on every
    rank of the job with the same ``path``, and an optimizer on every rank or on none (a rank whose stages hold no
    parameters passes ``None`` either way). The checkpoint may come from another layout (ranks, virtual stages,
    balance, schedule, ``dp_size``): each rank reads the entries of its own layers.

    Everything is checked on every rank before anything is read into the model (names and shapes of every entry
    against the unsplit model, the optimizer's hyperparameters), then all ranks vote, so a bad checkpoint is the
    same error on every rank and nothing is half-loaded. The tensors are read into new buffers and copied into the
    parameters, buffers and optimizer only once every rank has read them. The random generators are restored last
    (when the checkpoint has the same ranks and ``dp_size``), so the next step draws what it would have drawn.

    Args:
        path: the checkpoint directory (str or ``os.PathLike``), e.g. ``latest_checkpoint("ckpt")``.
        pipe: the :class:`~pipesched.runtime.Pipeline`.
        optimizer: ``None``, or the ``torch.optim.Optimizer`` over this rank's parameters to restore (the checkpoint
            must have been saved with one).
    Returns:
        :class:`CheckpointInfo` (``step``, ``extra``, ``rng_restored``).
    Raises:
        TypeError, ValueError: first, before anything is read, on every rank: a bad ``path``, ``pipe`` or
            ``optimizer`` type (on the other ranks: ``load_checkpoint: world rank R refused its arguments: ...``),
            ranks that give different ``path`` (absolute; names both ranks and paths) or different Pipelines
            (names both ranks and each one's Pipeline), an optimizer on
            some ranks and ``None`` on a rank that holds parameters (names both ranks), or ranks in different
            checkpoint calls (one saving while another loads: names each rank's).
        FileNotFoundError: ``path`` does not exist (names it).
        ValueError: ``path`` is not a complete pipesched checkpoint (no ``.metadata``: a save that did not finish;
            a save's temporary directory; a DCP checkpoint of something else), or it does not fit the model: the
            first offending name (missing from the checkpoint, unknown to the model, or of another shape), or the
            optimizer's (no optimizer state saved; a hyperparameter missing: another optimizer). Same on every rank.
        TimeoutError: a rank did not reach the load within ``pipe.timeout`` seconds (names it); or, on a rank that
            reaches the load after the others gave up waiting for it, naming them (it does not go on alone).
        RuntimeError: a rank could not allocate its read buffers (``load_checkpoint: world rank R failed while
            allocating its read buffers: <its error>``, voted before DCP's collectives) or failed while reading the
            files (names the ranks and errors), on every rank; nothing has been copied into the model or optimizer.
            Or a rank failed while copying what it read in (``load_checkpoint: world rank R failed while copying
            ...``, a last vote): on every rank, which must load again (the others' copies are done, that rank's may
            be partial).
    """
    _agree_load_arguments(path, pipe, optimizer)
    try:
        target, entries, meta = read_checkpoint(path)
        plan = pipe_read_plan(pipe)  # stored name -> this rank's tensors read from it
        found = {name[6:]: shape_of(md) for name, md in entries.items() if name.startswith("model.")}
        problem = first_mismatch(found, firsts(plan), pipe.state_spec, f"checkpoint {target!r}")
        optim_keys = [] if optimizer is None or problem else optimizer_keys(optimizer, pipe, entries, target)
        same_layout = [meta.get(k) for k in ("world_size", "pp_size", "dp_size")] == [
            pipe.grid.world_size, pipe.grid.pp_size, pipe.grid.dp_size]
        staging = None if problem else named_failure(  # before the vote (its error is every rank's): buffers
            lambda: staging_for(entries, plan, optim_keys, dist.get_rank() if same_layout else None, pipe.device),
            "load_checkpoint", dist.get_rank(), "allocating its read buffers")
        verdict = Verdict(ok={"problem": problem})
    except Exception as exc:  # noqa: BLE001 - every rank must learn it
        verdict = Verdict(error=exc)
    oks = vote("load_checkpoint", "checkpoint", verdict, pipe.timeout, pipe)
    problems = [ok["problem"] for ok in oks if ok["problem"]]
    if problems:
        raise ValueError(min(problems)[1])  # the same on every rank: missing names by model position, then the rest
    group = checkpoint_group(pipe)  # after the votes, on every rank alike: DCP waits at most pipe.timeout on it
    with failures_named(target, "reading"), lost_peer_named(pipe, target, "reading"):
        dcp.load(staging, checkpoint_id=target, process_group=group)  # collective; raises on every rank if one fails
    rng = staging.get("rng", {}).get(str(dist.get_rank()), {})

    def restore():
        copy_in(plan, staging["model"])
        if optimizer is not None:
            load_flat_state(optimizer, parameter_names(pipe), staging["optim"])
        rng_state.restore(rng, pipe.device)

    try:
        named_failure(restore, "load_checkpoint", dist.get_rank(), "copying what it read into its model, optimizer "
                       "and random generators")
        verdict = Verdict(ok=True)
    except Exception as exc:  # noqa: BLE001 - every rank must learn it (it would meet the others' next step)
        verdict = Verdict(error=exc)
    vote("load_checkpoint", "loaded", verdict, pipe.timeout, pipe)
    return CheckpointInfo(meta.get("step"), extra_of(meta, staging), bool(rng))


def load_into(model, path, strict: bool = True) -> CheckpointInfo:
    """Load a checkpoint's model tensors into the plain (unsplit) ``nn.Sequential`` in one process, e.g. for
    inference; no process group is needed (DCP's ``no_dist`` read). Checked first: nothing is copied unless every
    name (``strict``) and shape fits. A tensor ``model.state_dict()`` lists under several names (a tied weight) is
    read from its first name, which the checkpoint stores. The optimizer and RNG states are not read.

    Returns:
        :class:`CheckpointInfo` with ``step`` and ``extra`` (``rng_restored`` False).
    Raises:
        FileNotFoundError, ValueError: as :func:`load_checkpoint` (a missing, incomplete or foreign directory; the
            first name or shape that does not fit ``model``).
        TypeError: ``model`` is not an ``nn.Module``, or ``strict`` not a bool (names the argument and its value).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_into: model must be an nn.Module (the unsplit model), got {described(model)}")
    check_flag(strict, "strict", where="load_into: ")
    target, entries, meta = read_checkpoint(path)
    local = model.state_dict()
    spec = {name: tuple(t.shape) for name, t in local.items()}
    plan = read_plan(local, shared_aliases(model))  # a tied weight is read from its first name
    found = {name[6:]: shape_of(md) for name, md in entries.items() if name.startswith("model.")}
    problem = first_mismatch(found, firsts(plan), spec, f"checkpoint {target!r}", strict)
    if problem:
        raise ValueError(problem[1])
    plan = {name: ts for name, ts in plan.items() if name in found}
    staging = {"model": {n: empty_for(entries[f"model.{n}"]) for n in plan}}
    staging["extra"] = {n: empty_for(entries[f"extra.{n}"]) for n in meta.get("extra_tensors", [])}
    read_locally(staging, target)
    copy_in(plan, staging["model"])
    return CheckpointInfo(meta.get("step"), extra_of(meta, staging), False)


def latest_checkpoint(directory) -> str | None:
    """The newest complete checkpoint directly under ``directory`` (highest saved ``step``, then name; e.g.
    ``ckpt/step-000100`` over ``ckpt/step-000090``), or ``None`` if there is none (or no such directory).
    Hidden entries (a save's temporary directories) and anything that is not a complete pipesched checkpoint are
    skipped. Local: reads the directory on this rank only, so two ranks may get different answers (e.g. a save
    finishing in between, or a folder not shared); :func:`load_checkpoint` refuses different paths on every rank.

    Raises:
        TypeError: ``directory`` is not a ``str`` or ``os.PathLike`` (names it and the value).
        NotADirectoryError: ``directory`` is a file.
        ValueError: ``directory`` is ``""``.
        ValueError: ``directory`` is itself a checkpoint (it holds a ``.metadata``): pass the folder that holds the
            checkpoints, or load this one directly (a typo here would otherwise start a job again from step 0)."""
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"latest_checkpoint: directory must be a str or os.PathLike, got {described(directory)}")
    directory = os.fspath(directory)
    if not directory:
        raise ValueError("latest_checkpoint: directory is '' (an unset setting?); pass the folder that holds the "
                         "checkpoints ('.' for the current one)")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"latest_checkpoint: directory {directory!r} is a file, not the folder that holds "
                                 f"the checkpoints")
    if not os.path.isdir(directory):
        return None
    if os.path.isfile(os.path.join(directory, ".metadata")):
        raise ValueError(f"latest_checkpoint: directory {directory!r} is a checkpoint itself; pass the folder that "
                         f"holds the checkpoints ({os.path.dirname(os.path.abspath(directory))!r}), or "
                         f"load_checkpoint({directory!r}, ...) directly")
    found = []
    for name in os.listdir(directory):
        if name.startswith("."):
            continue
        try:
            target, _, meta = read_checkpoint(os.path.join(directory, name))
        except (OSError, ValueError):
            continue
        step = meta.get("step")
        found.append((-1 if step is None else step, name, target))
    return max(found)[2] if found else None


# ---- arguments every rank must agree on ----------------------------------------------------------------------


def _check_pipe(pipe) -> None:
    """Refuse a ``pipe`` that is not a Pipeline, inside the first vote's ``try``: every rank learns it at once."""
    from .pipeline import Pipeline  # the pipeline's modules are imported after this one

    if not isinstance(pipe, Pipeline):
        raise TypeError(f"pipe must be a pipesched.runtime.Pipeline, got {type(pipe).__name__}")


def _pipe_of(args: tuple, kwargs: dict):
    """The Pipeline of a checkpoint call's arguments (its second, ``pipe``), ``None`` where it is not one."""
    from .pipeline import Pipeline

    pipe = kwargs.get("pipe", args[1] if len(args) > 1 else None)
    return pipe if isinstance(pipe, Pipeline) and dist.is_initialized() else None


def _refuse_misfit(call: str, pipe, error: TypeError) -> None:
    """A checkpoint call whose arguments do not fit (``save_checkpoint(path, pipe, optimiser=opt)``) on this rank:
    its refusal in the call's first vote, so every rank raises it instead of waiting for this one
    (:mod:`~pipesched.runtime.misfit`)."""
    vote(call, "arguments", Verdict(error=error), pipe.timeout, pipe)


def _timeout_of(pipe) -> float | None:
    """``pipe.timeout``, or ``None`` (the vote's fallback) where ``pipe`` is not a Pipeline (refused in the vote)."""
    from .pipeline import Pipeline

    return pipe.timeout if isinstance(pipe, Pipeline) else None


def _which(pipe) -> str:
    """Which of the job's Pipelines ``pipe`` is, the same on every rank for one Pipeline and another for any other
    (its construction's round, :func:`~pipesched.runtime.agreement.agree`), so that rank-dependent code saving
    (loading) ``pipe_a`` on one rank and ``pipe_b`` on another at one path is refused on every rank, not a
    checkpoint mixing two models' layers."""
    return (f"Pipeline #{pipe._construction} of the job ({pipe.program.schedule}, {sum(pipe.balance)} layers, "
            f"{len(pipe.state_spec)} tensors)")


def _check_same_extra(oks: list) -> None:
    """Refuse ranks that passed different ``extra`` (compared by
    :func:`~pipesched.runtime.checkpoint_write.extra_summary`): the checkpoint holds one ``extra`` and
    :func:`load_checkpoint` gives it to every rank, so keeping one rank's would silently hand the others a value they
    never passed (e.g. a metric only the last stage's rank computed, ``None`` on rank 0, or a replica's own loss)."""
    try:
        check_same(oks, "extra", "save_checkpoint")
    except ValueError as exc:
        raise ValueError(f"{exc} (the checkpoint keeps one extra, which load_checkpoint gives every rank: make values "
                         f"that differ between ranks equal first, e.g. all-reduce them, or leave them out)") from None


def _optimizer_given(pipe, optimizer) -> dict:
    """What :func:`~pipesched.runtime.vote.check_optimizers` compares: whether this rank gave an optimizer and
    whether its stages hold any parameter."""
    return {"optimizer": optimizer is not None, "parameters": any(True for _ in pipe.parameters())}


def _agree_load_arguments(path, pipe, optimizer) -> None:
    """Vote on ``load_checkpoint``'s arguments before anything is read: the same ``path`` (absolute) on every rank,
    and an optimizer on every rank holding parameters or on none (:func:`~pipesched.runtime.vote.check_optimizers`).
    """
    try:
        _check_pipe(pipe)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
        verdict = Verdict(ok={"path": as_path(path), "pipeline": _which(pipe), **_optimizer_given(pipe, optimizer)})
    except Exception as exc:  # noqa: BLE001 - every rank must learn it
        verdict = Verdict(error=exc)
    oks = vote("load_checkpoint", "arguments", verdict, _timeout_of(pipe), pipe)
    check_same(oks, "path", "load_checkpoint")
    check_same(oks, "pipeline", "load_checkpoint")
    check_optimizers(oks, "load_checkpoint")
