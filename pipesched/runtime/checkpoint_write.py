"""Writing a pipesched checkpoint (:mod:`~pipesched.runtime.checkpoint`'s format): a save's argument checks, the
state each rank writes, the atomic rename that commits it, and failures named by rank and checkpoint (the reading
side is :mod:`~pipesched.runtime.checkpoint_read`)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..checks import as_int
from . import rng_state
from .wire import as_bytes
from .failure import CommError, describe
from .optim_state import check_owned, flat_state
from .torch_errors import peer_closed_connection, wait_timed_out
from .state import parameter_names, saved_state
from .checkpoint_read import FORMAT, REPLACED, SAVING, as_path, hidden, read_checkpoint


def check_save(path, pipe, optimizer, step, extra, rank: int) -> str:
    target = as_path(path)
    if step is not None and (as_int(step) is None or step < 0):
        raise ValueError(f"step must be None or an int >= 0, got {step!r}")
    split_extra(extra)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_owned(optimizer, parameter_names(pipe))
    if os.path.lexists(target):
        try:
            read_checkpoint(target)
        except (OSError, ValueError):
            raise FileExistsError(f"path {target!r} exists and is not a pipesched checkpoint; refusing to replace "
                                  f"it (save elsewhere or remove it)") from None
    if rank == 0:  # a stale temporary directory of a save that died is removed; the new one made
        temp = hidden(target, SAVING)
        shutil.rmtree(temp, ignore_errors=True)
        os.makedirs(temp)
    return target


def state_to_save(pipe, optimizer, step, extra, rank: int) -> dict:
    state: dict = {"model": replica_state(pipe), "rng": {str(rank): rng_state.capture(pipe.device)}}
    if optimizer is not None:
        state["optim"] = flat_state(optimizer, parameter_names(pipe))
    if rank == 0:
        text, tensors = split_extra(extra)
        grid = pipe.grid
        state["pipesched"] = {"format": FORMAT, "step": step, "world_size": grid.world_size, "pp_size": grid.pp_size,
                              "dp_size": grid.dp_size, "extra": text, "extra_tensors": list(tensors)}
        if tensors:
            state["extra"] = tensors
    return state


def replica_state(pipe) -> dict:
    """:func:`saved_state`, less the buffers on a replica other than the first: with ``dp_size > 1`` buffers such as
    BatchNorm's running statistics are each replica's own (its data's), and DCP writes a name several ranks save
    once, from any of them: a mean from one replica and a variance from another would belong to none. So the
    checkpoint holds replica 0's buffers, together."""
    state = saved_state(pipe)
    if pipe.grid.dp_rank == 0:
        return state
    buffers = {b.data_ptr() for module in pipe.stages.values() for b in module.buffers() if b.numel()}
    return {name: t for name, t in state.items() if not (t.numel() and t.data_ptr() in buffers)}


def commit(temp: str, target: str) -> None:
    """Rename the finished temporary directory to ``target`` (replacing a checkpoint there) and sync the parent."""
    old = None
    if os.path.lexists(target):
        old = hidden(target, REPLACED)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(temp, target)
    fd = os.open(os.path.dirname(target), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def split_extra(extra) -> tuple[str, dict]:
    tensors = {}
    plain = extra
    if isinstance(extra, dict):
        plain = {}
        for key, value in extra.items():
            if not isinstance(key, str):
                raise TypeError(f"extra must have str keys, got {key!r}")
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach()
            else:
                plain[key] = value
    try:
        return json.dumps(plain), tensors
    except (TypeError, ValueError) as exc:
        raise TypeError(f"extra must be JSON-serialisable (dict, list, str, int, float, bool, None), or a dict whose "
                        f"top-level values may also be tensors; got {extra!r} ({exc})") from None


EXTRA_SHOWN = 120  # characters of extra's JSON text a save's vote (and its error) shows in full


def extra_summary(extra) -> str:
    """What a save's vote compares every rank's ``extra`` by (a checked ``extra``: :func:`split_extra` passed): its
    JSON text with sorted keys (over :data:`EXTRA_SHOWN` characters: cut, with its length and a digest, so that two
    texts cut alike still differ), then each tensor's name, dtype, shape and a digest of its bytes."""
    text, tensors = split_extra(extra)
    text = json.dumps(json.loads(text), sort_keys=True)  # the round trip makes nested keys str (sortable)
    if len(text) > EXTRA_SHOWN:
        text = f"{text[:EXTRA_SHOWN - 20]}... ({len(text)} characters, digest {_digest(text.encode())})"
    parts = [text]
    for name, t in sorted(tensors.items()):
        try:
            digest = _digest(as_bytes(t).cpu().numpy().tobytes())
        except Exception:  # noqa: BLE001 - a layout without plain bytes (sparse): compared by dtype and shape only
            digest = str(t.layout)
        parts.append(f"tensor {name!r}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, digest {digest}")
    return "; ".join(parts)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def named_failure(run, caller: str, rank: int, doing: str):
    """``run()``; an exception it raises becomes a ``RuntimeError`` naming ``caller``, this world rank, what it was
    ``doing`` and the original (``"ExceptionType: message"``), so the vote that follows raises a message naming the
    rank that failed on every rank (the others would otherwise wait in DCP's collectives)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - every rank must learn it, naming this one
        raise RuntimeError(f"{caller}: world rank {rank} failed while {doing}: {describe(exc)}") from exc


@contextlib.contextmanager
def lost_peer_named(pipe, target: str, doing: str):
    """A peer whose process ended inside DCP's collectives (killed while writing or reading: gloo raises a plain
    ``RuntimeError``, "Connection reset by peer", naming no rank) ends this rank as a step or
    :meth:`~pipesched.runtime.Pipeline.run_collective` does (:mod:`~pipesched.runtime.collective`): a
    ``PipelineError`` naming the lost rank, or the failure record of the rank that failed first; ``pipe`` is
    unusable afterwards. A wait that timed out (DCP's group has ``pipe.timeout``:
    :mod:`~pipesched.runtime.checkpoint_group`) ends as a step's does: the roll call of every world rank names the
    ranks that did not time out with this one (a rank stalled inside DCP's write or read). Any other exception
    passes as it is."""
    try:
        yield
    except RuntimeError as exc:
        if not (peer_closed_connection(exc) or wait_timed_out(exc)):
            raise
        caught = exc  # the except clause's name is unbound when it ends; the closure keeps its own
        what = f"DCP's collectives while {doing} {target!r}"

        def again():  # as peer_loss_as_comm_error, for a timeout too
            error = CommError(what, caught)
            error.during = "the checkpoint save" if doing == "writing" else "the checkpoint load"  # the roll call's
            raise error from None
        pipe._guarded(again, where=f"while {doing} checkpoint {target!r} (DCP's collectives)")
        raise AssertionError("_guarded returned from a failing call")  # unreachable: it raises a PipelineError


@contextlib.contextmanager
def failures_named(target: str, doing: str):
    """DCP reports a failure on any rank as a ``CheckpointException`` (a ``BaseException``) on every rank: make it a
    ``RuntimeError`` naming the checkpoint, the ranks and their errors."""
    try:
        yield
    except CheckpointException as exc:
        ranks = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
        raise RuntimeError(f"checkpoint {target!r}: ranks failed while {doing} it ({ranks})") from exc
