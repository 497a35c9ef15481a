"""The process group DCP's collectives run on in :func:`~pipesched.runtime.save_checkpoint` and
:func:`~pipesched.runtime.load_checkpoint`: every world rank, with the Pipeline's ``timeout`` and the stages' backend
(gloo on CPU, NCCL on CUDA: :func:`~pipesched.runtime.comm.backend_for`), not the default group (whose timeout is
torch's 30-minute default under :func:`~pipesched.runtime.launch`, or whatever the user gave torchrun's
``init_process_group``): a rank that stalls inside DCP's write or read makes the others' wait end after
``pipe.timeout``, naming it (:func:`~pipesched.runtime.checkpoint_write.lost_peer_named`).

Created at the first save or load of a Pipeline, after that call's argument vote (which every rank passes or every
rank fails, so every rank creates it at the same point of its calls, as ``dist.new_group`` needs), kept as
``pipe._checkpoint_group`` and destroyed with the Pipeline's other groups
(:func:`~pipesched.runtime.pipeline_failure.teardown`: at ``close()`` or a failure). Its failure key joins the
Pipeline's failure channel, so the roll call of a timed-out DCP wait reaches every world rank.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .comm import backend_for
from .failure import CommError

CREATING = "while creating the checkpoint's process group (dist.new_group, every world rank)"


def checkpoint_group(pipe):
    """``pipe``'s group over every world rank for DCP's collectives (created on first use: collective, call it at the
    same point on every rank)."""
    group = getattr(pipe, "_checkpoint_group", None)
    if group is None:
        group = pipe._guarded(lambda: _new_group(pipe), where=CREATING)
        pipe._checkpoint_group = group
        key = f"pipesched/{group.group_name}/error"  # the same name on every rank: a channel key they all share
        for keys in (pipe._failures.keys, pipe._failures.read_keys):
            if key not in keys:
                keys.append(key)
    return group


def _new_group(pipe):
    """The group; a creation whose wait for the peers timed out (``DistStoreError``: a peer stalled between the
    call's vote and here) is a :class:`~pipesched.runtime.failure.CommError`, so the Pipeline's failure names the
    members of this rank's groups that did not time out with it (:mod:`~pipesched.runtime.stalled`); anything else
    is this rank's own failure, published for the others (:meth:`Pipeline._guarded`)."""
    try:
        return dist.new_group(list(range(pipe.grid.world_size)), timeout=datetime.timedelta(seconds=pipe.timeout),
                              backend=backend_for(pipe.device))
    except dist.DistStoreError as exc:
        error = CommError("every world rank to create the checkpoint's process group", exc)
        error.during = "the creation of the checkpoint's process group"  # the roll call's words (stalled.py)
        raise error from None
