"""Per-rank bodies of tests/runtime/test_zb_auto_runtime.py: zb-auto in Pipeline (built from given costs) against
the unsplit model."""
from __future__ import annotations

import pipesched as ps

from rt_workers import transparency

#: costs under which the greedy (not a handcrafted fallback) wins on 2 ranks: slow messages, cheap W
COSTS = ps.CostModel(forward=1.0, backward=1.5, input_grad=1.0, weight_grad=0.5, latency=1.0)


def suite(rank):
    """2 ranks: zb-auto with COSTS and a limit of 3 (m = 4, n = 8; m = 8, n = 10: uneven microbatches), and the
    program the pipeline runs against compile_program's."""
    out = {}
    for m, n in ((4, 8), (8, 10)):
        case = transparency(rank, "zb-auto", 1, m=m, n=n, steps=2, costs=COSTS, memory_limit=3)
        expected = ps.compile_program("zb-auto", 2, m, costs=COSTS, memory_limit=3)
        case["chosen"] = expected.meta["zb_auto"]["chosen"]
        case["peak"] = ps.simulate(expected, COSTS).peak_inflight
        out[m] = case
    return out
