"""One cell of a torch.distributed.pipelining schedule CSV: the action grammar of torch 2.13's ``_Action``.

Torch writes an action as ``[stage][kind][microbatch]`` (``2F0``, ``3SEND_B1``, ``1UNSHARD``) and an overlapped
group as ``(sub;sub)OVERLAP_F_B`` (``(0F5;5B2)OVERLAP_F_B``: the forward of one microbatch and the backward of
another, which DualPipe-V overlaps). This module reads and writes that text without importing torch; it is
stricter than torch's reader, which ignores whatever follows a valid prefix (torch reads ``2F0x`` as ``2F0``).
"""
from __future__ import annotations

import re
from typing import NamedTuple

#: torch's action kinds (``_ComputationType`` values) that run a stage's computation
COMPUTE_KINDS = ("F", "B", "I", "W")
#: torch's point-to-point kinds; the stage is the sender's (SEND) or the receiver's (RECV), as in pipesched
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: FSDP-only kinds: fetch / release a stage's sharded parameters (no counterpart in pipesched)
FSDP_KINDS = ("UNSHARD", "RESHARD")
#: the gradient reduction after a stage's last backward (FSDP post-backward, DP reduction, scaling by 1/m)
REDUCE_GRAD = "REDUCE_GRAD"
#: the container kind whose sub-actions run one after the other (an executor may overlap them)
OVERLAP_F_B = "OVERLAP_F_B"

_KINDS = COMPUTE_KINDS + COMM_KINDS + FSDP_KINDS + (REDUCE_GRAD,)
_SINGLE = re.compile(r"(\d+)(" + "|".join(sorted(_KINDS, key=len, reverse=True)) + r")(\d*)")
_GROUP = re.compile(r"\((?P<subs>[^()]*)\)(?P<kind>[A-Z_]+)")
_NO_MICROBATCH = FSDP_KINDS + (REDUCE_GRAD,)


class TorchAction(NamedTuple):
    """One torch action: ``kind`` (a torch kind, e.g. ``"F"``, ``"SEND_B"``, ``"UNSHARD"``), ``stage`` (global
    stage index), ``microbatch`` (``None`` for UNSHARD, RESHARD, REDUCE_GRAD), or an ``OVERLAP_F_B`` group whose
    compute actions are ``subs`` (``stage`` and ``microbatch`` then ``None``)."""

    kind: str
    stage: int | None
    microbatch: int | None = None
    subs: tuple["TorchAction", ...] = ()

    def __str__(self) -> str:
        if self.subs:
            return "(" + ";".join(map(str, self.subs)) + ")" + self.kind
        return f"{self.stage}{self.kind}" + ("" if self.microbatch is None else str(self.microbatch))


def parse_action(text: str) -> TorchAction | None:
    """The action a CSV cell holds; ``None`` for an empty cell (torch's idle slot).

    Raises:
        ValueError: the cell is not an action of torch 2.13 (the message says what is expected).
    """
    text = text.strip()
    if not text:
        return None
    group = _GROUP.fullmatch(text)
    if group is not None:
        return _parse_group(group["kind"], group["subs"])
    single = _SINGLE.fullmatch(text)
    if single is None:
        raise ValueError(f"cannot read torch action {text!r}: expected [stage][kind][microbatch] (e.g. 2F0, "
                         f"3SEND_B1, 1UNSHARD; kinds: {', '.join(_KINDS)}) or (2F0;3B1)OVERLAP_F_B")
    stage, kind, mb = single.groups()
    if kind in _NO_MICROBATCH:
        if mb:
            raise ValueError(f"torch action {text!r}: {kind} takes no microbatch")
        return TorchAction(kind, int(stage))
    if not mb:
        raise ValueError(f"torch action {text!r}: {kind} needs a microbatch (e.g. {stage}{kind}0)")
    return TorchAction(kind, int(stage), int(mb))


def _parse_group(kind: str, subs_text: str) -> TorchAction:
    if kind != OVERLAP_F_B:
        raise ValueError(f"cannot read torch action group ({subs_text}){kind}: the only group kind is {OVERLAP_F_B}")
    subs = tuple(parse_action(s) for s in subs_text.split(";"))
    if not subs or any(s is None or s.kind not in COMPUTE_KINDS for s in subs):
        raise ValueError(f"torch action ({subs_text}){kind}: an {OVERLAP_F_B} group holds compute actions "
                         f"({', '.join(COMPUTE_KINDS)}) joined by ';', e.g. (0F5;5B2){OVERLAP_F_B}")
    return TorchAction(OVERLAP_F_B, None, None, subs)
