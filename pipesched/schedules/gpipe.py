"""GPipe: all forwards, then all backwards (Huang et al., 2019, arXiv:1811.06965)."""
from __future__ import annotations

from .. import placement
from ._common import backward, check_one_stage_sizes, forward, program


def build_gpipe(num_ranks: int, num_microbatches: int, virtual_stages: int = 1):
    """GPipe (arXiv:1811.06965): every rank runs F for microbatches 0..m-1, then B for 0..m-1.

    Bubble fraction with uniform costs: (p-1)/(m+p-1). Peak in-flight activations: m on every rank,
    the price of its simplicity. Any m >= 1 works. One stage per rank (``virtual_stages`` must be 1).

    Raises:
        ScheduleArgumentError: a size is not a positive integer, or ``virtual_stages != 1``.
    """
    p, m = check_one_stage_sizes("gpipe", num_ranks, num_microbatches, virtual_stages)
    streams = [[forward(r, mb) for mb in range(m)] + [backward(r, mb) for mb in range(m)] for r in range(p)]
    return program("gpipe", streams, placement.contiguous(p), m)

