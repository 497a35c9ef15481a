"""Per-rank body of tests/runtime/test_link_overhead.py: profile_link's send overhead on 2 ranks (one launch)."""
import torch

from pipesched.demo.planning import _link
from pipesched.runtime import profile_link
from pipesched.runtime.link_profile import _round_trip

SMALL = 1 << 8  # bytes: the smallest message of the small-size profile below


def suite(rank):
    torch.set_num_threads(1)
    out = {"demo": _link(rank),  # what `demo --plan` measures (measure_link launches _link on 2 ranks)
           "small": profile_link(nbytes=(SMALL, 1 << 14, 1 << 18), repeat=9)}  # medians of 18 send calls
    # the one-way time of a SMALL message measured apart (half the median round trip of 15, on rank 0)
    trip, _ = _round_trip(SMALL, rank == 0, 1 - rank, 15, None, torch.device("cpu"))
    out["one_way"] = trip / 2
    return out
