"""Pinned outputs of zb-auto's greedy (``greedy_streams``) and the partition branch and bound (``least_max``) on
small hand-checkable inputs: they guard refactors of both against any change of behaviour."""
import pytest

from pipesched.cost import CostModel
from pipesched.partition_search import least_max
from pipesched.schedules import zb_auto

COSTS = CostModel(forward=(1.0, 1.5, 1.0), input_grad=(1.0, 1.0, 2.0), weight_grad=(3.0, 0.5, 0.5), latency=0.25)
LAST = "F0 I0 F1 I1 W0 W1 F2 I2 W2 F3 I3 W3"


@pytest.mark.parametrize("mode, warmup, streams", [
    (("i-first", "fill"), (1, 0), ["F0 F1 I0 W0 I1 F2 W1 F3 I2 W2 I3 W3", "F0 F1 I0 W0 I1 W1 F2 F3 I2 W2 I3 W3", LAST]),
    (("i-first", "fill"), (0, None), ["F0 F1 I0 W0 I1 F2 W1 F3 I2 W2 I3 W3", "F0 F1 I0 W0 I1 W1 F2 F3 I2 W2 I3 W3",
                                      LAST]),
    (("alternate", "fit"), (1, 0), ["F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3", "F0 F1 I0 W0 I1 W1 F2 I2 F3 W2 I3 W3",
                                    LAST]),
])
def test_greedy_streams_pinned(mode, warmup, streams):
    times = zb_auto._stage_times(COSTS, 3)
    got = zb_auto.greedy_streams(3, 4, (2, 3, 3), times, mode, zb_auto.warmup(3, *warmup))
    assert [" ".join(f"{i.op.value}{i.microbatch}" for i in stream) for stream in got] == streams
    assert all(i.stage == r for r, stream in enumerate(got) for i in stream)


P = [0, 5, 9, 20, 22, 30, 31, 40]  # layer costs 5 4 11 2 8 1 9
LAYERS = [0, 1, 2, 3, 4, 5, 6, 7]


def test_least_max_pinned():
    assert least_max((P, [0, 1, 2]), [], [], [None]) == [0, 2, 4, 7]  # loads 9, 13, 18
    assert least_max((P, [0, 1, 0, 1]), [], [], [None]) == [0, 2, 3, 6, 7]  # owners 20, 20
    assert least_max((P, [0, 1, 0, 1]), [(LAYERS, [0, 1, 0, 1], 4)], [], [None]) == [0, 2, 3, 5, 7]
    assert least_max((P, [0, 1, 0, 1]), [(LAYERS, [0, 1, 0, 1], 3)], [], [None]) is None  # 7 layers, 2 x 3
    assert least_max((P, [0, 1, 2]), [], [[0, 2, 4, 7]], [None]) == [0, 2, 4, 7]  # the seed is already best
    assert least_max((P, [0, 1, 2]), [], [], [None], first=True, order="lexicographic") == [0, 1, 2, 7]
    assert least_max((P, [0, 1, 0, 1]), [], [], [None], order="layers") == [0, 2, 3, 6, 7]
    assert least_max(([0, 10, 26, 31, 32], [0, 1]), [], [], [None], order="layers") == [0, 1, 4]  # 10 vs 22
    assert least_max(([0, 15, 18, 36, 40], [0, 1, 2]), [], [], [None], order="layers") == [0, 2, 3, 4]  # 18, 18, 4


@pytest.mark.parametrize("nodes, cut, left", [(1, [0, 1, 2, 7], 0), (3, [0, 2, 4, 7], 0), (6, [0, 2, 4, 7], 3),
                                             (20, [0, 2, 4, 7], 17)])
def test_least_max_budget_pinned(nodes, cut, left):
    budget = [nodes]
    assert least_max((P, [0, 1, 2]), [], [[0, 1, 2, 7]], budget) == cut
    assert budget == [left]
