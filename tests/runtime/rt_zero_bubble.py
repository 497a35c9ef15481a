"""Per-rank bodies of tests/runtime/test_zero_bubble*.py: zb-h1 and zb-h2 in Pipeline against the unsplit model
(losses equal and gradients bitwise, over optimizer steps; DP x PP = 2 x 2)."""
from __future__ import annotations

from rt_workers import dp_case, transparency

SCHEDULES = ("zb-h1", "zb-h2")


def pipeline_suite(rank):
    """Every rank of one pipeline (2 or 4 ranks): each schedule plain and with recompute, m = 4 (n = 8) and
    m = 8 on an uneven batch (n = 10: microbatches of 2 and 1), and program order (early_receives=False)."""
    out = {}
    for schedule in SCHEDULES:
        for options in ({}, {"recompute": True}):
            key = tuple(sorted(options))
            out[(schedule, key, 4)] = transparency(rank, schedule, 1, m=4, n=8, **options)
            out[(schedule, key, 8)] = transparency(rank, schedule, 1, m=8, n=10, steps=2, **options)
        out[(schedule, "program-order", 8)] = transparency(rank, schedule, 1, m=8, n=10, steps=1,
                                                           early_receives=False)
    return out


def dp_suite(rank):
    """4 ranks as DP 2 x PP 2 (plain and with recompute)."""
    return {(schedule, recompute): dp_case(rank, schedule, 1, recompute=recompute)
            for schedule in SCHEDULES for recompute in (False, True)}


def four_rank_suite(rank):
    return {"pipeline": pipeline_suite(rank), "dp": dp_suite(rank)}


def check_pipeline_case(case, recompute):
    """Asserted in the parent: every step's loss equal and gradients bitwise, the parameters bitwise after the
    AdamW steps, and the builder's split (I and W, no B; R iff recompute) is what ran."""
    for step in case["steps"]:
        assert step["loss_equal"] is True and step["bitwise"] is True and step["grads"] > 0, case
    assert case["params_equal"] is True, case
    assert {"I", "W"} <= set(case["ops"]) and "B" not in case["ops"], case["ops"]
    assert ("R" in case["ops"]) is recompute, case["ops"]
