"""The words of the step protocol (:mod:`pipesched.protocol`): one message post (:class:`Post`), the step-level
messages that belong to no instruction (:data:`OPENING`, :data:`REPLICAS`, :data:`LOSS`, :data:`NORM`), and how a
message reads in an error (:func:`describe`). Shared by the posts (:mod:`pipesched.protocol`) and their checks
(:mod:`pipesched.protocol_check`). Torch-free.
"""
from __future__ import annotations

from typing import NamedTuple


class Post(NamedTuple):
    """One message post: ``kind`` ``"send"`` or ``"recv"`` (point to point, with the ``peer`` pipeline rank) or
    ``"all_gather"`` (a collective, ``peer`` ``None``: the one that opens the step, on the whole pipeline group,
    message :data:`OPENING`; with ``dp_size > 1`` the replicas' agreement right after it, on the data-parallel
    group, message :data:`REPLICAS`); the ``message``: ``(kind, stage, microbatch)`` with kind ``"act_header"``,
    ``"act"`` (the output of ``stage``), ``"grad"`` (the gradient of ``stage``'s input), ``"loss"`` or ``"norm"``
    (:data:`LOSS`, :data:`NORM`); ``tensors``: the number of tensors a gradient message carries
    (:func:`~pipesched.protocol.gradient_tensors`), ``None`` for the other messages (an activation carries the
    stage's output tensors, the others one tensor each)."""

    kind: str
    peer: int | None
    message: tuple
    tensors: int | None = None


LOSS = ("loss", None, None)  #: the step's loss, from the last stage's rank
OPENING = ("opening", None, None)  #: the all-gather that opens every step (handshake, with the verdict on the target)
REPLICAS = ("replicas", None, None)  #: the replicas' agreement: the all-gather over the data-parallel group (dp > 1)
NORM = ("norm", None, None)  #: a rank's part of the gradient norm, to every other pipeline rank (norm_parts)


def describe(message: tuple) -> str:
    """A message ``(kind, stage, microbatch)`` in words, as the checks' errors name it."""
    kind, stage, mb = message
    return {"loss": "the step's loss", "opening": "the step's opening all-gather", "norm": "the norm part",
            "replicas": "the replicas' agreement (the all-gather on the data-parallel group)",
            "act_header": f"the shape header of stage {stage}'s output, microbatch {mb}",
            "act": f"stage {stage}'s output, microbatch {mb}",
            "grad": f"the gradient of stage {stage}'s input, microbatch {mb}"}[kind]
