"""What each ALL_REDUCE of one rank averages, decided once per program: a parameter shared by two of the
rank's stages is averaged once."""
from __future__ import annotations

from ..ir import Op


def reduced_params(params: dict, stream) -> dict:
    """{stage: the parameters its ALL_REDUCE averages}: a parameter shared by two of this rank's stages is
    averaged once, by the later of their ALL_REDUCEs, when both stages' gradients are in."""
    order = {i.stage: k for k, i in enumerate(stream) if i.op is Op.ALL_REDUCE}
    last: dict = {}  # id(param) -> the stage whose ALL_REDUCE comes last
    for s, ps in params.items():
        for p in ps:
            if order.get(s, -1) >= order.get(last.get(id(p), s), -1):
                last[id(p)] = s
    return {s: [p for p in ps if last[id(p)] == s] for s, ps in params.items()}
