"""Per-rank body of tests/runtime/test_link_overhead.py: profile_link's send overhead on 2 ranks (one launch)."""
import torch

from pipesched.demo.planning import _link
from pipesched.runtime import profile_link

SMALL = 1 << 8  # bytes: the smallest message of the small-size profile below


def suite(rank):
    torch.set_num_threads(1)
    return {"demo": _link(rank),  # what `demo --plan` measures (measure_link launches _link on 2 ranks)
            "small": profile_link(nbytes=(SMALL, 1 << 14, 1 << 18), repeat=9)}  # medians of 18 send calls
