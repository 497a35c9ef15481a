"""Per-rank bodies of tests/runtime/test_wgrad_fusion.py: Pipeline with ``gradient_accumulation_fusion=True``
against the unsplit model, counting the W groups the fused path took and declined."""
from __future__ import annotations

import contextlib


import pipesched.runtime.split as split
from pipesched.runtime import Pipeline

from rt_cases import mlp
from rt_workers import transparency


@contextlib.contextmanager
def counted():
    """Counts ``fused_linear_weight``'s answers in this process: {"fused": n, "declined": n}."""
    calls, original = {"fused": 0, "declined": 0}, split.fused_linear_weight

    def spy(*args):
        took = original(*args)
        calls["fused" if took else "declined"] += 1
        return took
    split.fused_linear_weight = spy
    try:
        yield calls
    finally:
        split.fused_linear_weight = original


def suite(rank):
    """zbv, zb-h1, 1f1b (its B run as I then W) and zbv with recompute (m = 4, 2 rows per microbatch, 3 AdamW
    steps), zbv on 300-row microbatches, the flag off (never asked), and a flag that is no bool (refused on every
    rank before any communication)."""
    out = {}
    for name, schedule, v, n, options in (("zbv", "zbv", 2, 8, {}), ("zb-h1", "zb-h1", 1, 8, {}),
                                          ("zbv-rows", "zbv", 2, 1200, {}), ("1f1b", "1f1b", 1, 8, {}),
                                          ("zbv-recompute", "zbv", 2, 8, {"recompute": True})):
        with counted() as calls:
            case = transparency(rank, schedule, v, m=4, n=n, gradient_accumulation_fusion=True, **options)
        out[name] = {"case": case, "calls": dict(calls)}
    with counted() as calls:
        case = transparency(rank, "zbv", 2, m=4, n=8)
    out["off"] = {"case": case, "calls": dict(calls)}
    try:
        Pipeline(mlp(), schedule="zbv", num_microbatches=4, gradient_accumulation_fusion="yes")
    except TypeError as exc:
        out["refused"] = str(exc)
    pipe = Pipeline(mlp(), schedule="zbv", num_microbatches=4, gradient_accumulation_fusion=True)
    out["property"] = pipe.gradient_accumulation_fusion
    pipe.close()
    return out
