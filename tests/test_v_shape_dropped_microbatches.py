"""ZB-V and DualPipe-V for m < n build only the kept microbatches (n = 2p - 1 or 2p): the result must equal the
full order for n, filtered to microbatches < m, as the builders defined it before they skipped the dropped ones."""
import pytest

from pipesched import build
from pipesched.ir import OVERLAP_PAIRS, Op
from pipesched.schedules import dualpipe_v, v_shape

SIZES = [(p, m) for p in range(1, 13) for m in range(1, 2 * p + 3)] + [
    (p, m) for p in (23, 40) for m in (1, 2, 3, p - 1, p, p + 1, 2 * p - 2, 2 * p - 1, 2 * p, 2 * p + 1)]


def _zbv_filtered(p, m):
    n = max(m, 2 * p - 1)
    return tuple(tuple(i for i in v_shape._rank_order(r, p, n, n) if i.microbatch < m) for r in range(p))


def _dualpipev_filtered(p, m):
    n = max(m, 2 * p)
    ranks, pairs = [], []
    for r in range(p):
        order = dualpipe_v._RankOrder(r, p, n, n)  # nothing dropped: the full order for n
        order.run()
        ranks.append(tuple(i for i in order.out if i.microbatch < m))
        pairs += [(f, b) for f, b in order.pairs if f.microbatch < m and b.microbatch < m]
    return tuple(ranks), tuple(pairs)


@pytest.mark.parametrize("p, m", SIZES)
def test_zbv_equals_the_full_order_filtered(p, m):
    assert build("zbv", p, m).ranks == _zbv_filtered(p, m)


@pytest.mark.parametrize("p, m", SIZES)
def test_dualpipev_equals_the_full_order_filtered(p, m):
    built = build("dualpipev", p, m)
    ranks, pairs = _dualpipev_filtered(p, m)
    assert built.ranks == ranks
    assert built.meta[OVERLAP_PAIRS] == pairs


def test_large_p_small_m_counts():
    # m = 2 at p = 300: each rank keeps its 2 microbatches of each stage (zbv: F, I, W; dualpipev: F and B or I+W)
    zbv = build("zbv", 300, 2)
    assert [len(rank) for rank in zbv.ranks] == [12] * 300
    dpv = build("dualpipev", 300, 2)
    assert sum(len(rank) for rank in dpv.ranks) == sum(len(rank) for rank in _dualpipev_filtered(300, 2)[0])
    assert all(i.microbatch < 2 for rank in dpv.ranks for i in rank)
    assert {i.op for rank in zbv.ranks for i in rank} == {Op.F, Op.I, Op.W}
