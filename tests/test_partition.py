"""balance_by_time: exact against brute force over all contiguous cuts (one stage per rank, looped, V), ties,
memory, errors."""
import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesched.partition import balance_by_time, rank_loads
from pipesched.placement import looped, vshape


def values(costs, balance, s2r=None, memory=None):
    """What balance_by_time minimises, in order: (slowest rank's time, largest rank memory, slowest stage's time),
    exact sums (Fractions)."""
    costs = [Fraction(c) for c in costs]
    mem = max(rank_loads([Fraction(m) for m in memory], balance, s2r)) if memory is not None else 0
    return max(rank_loads(costs, balance, s2r)), mem, max(rank_loads(costs, balance))


def several_per_rank(s2r):
    return s2r is not None and len(set(s2r)) < len(s2r)


def brute_force(costs, num_stages, s2r=None, memory=None, limit=None):
    """Every contiguous cut in lexicographic order; the first with the least (slowest rank's time, largest rank
    memory, slowest stage's time), exact sums (Fractions). None: no cut within ``limit``."""
    n, best = len(costs), None
    costs = [Fraction(c) for c in costs]
    memory = [Fraction(m) for m in memory] if memory is not None else None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        balance = tuple(b - a for a, b in zip((0,) + cuts, cuts + (n,)))
        mem = max(rank_loads(memory, balance, s2r)) if memory is not None else 0
        if limit is not None and mem > limit:
            continue
        value = (max(rank_loads(costs, balance, s2r)), mem, max(rank_loads(costs, balance)))
        if best is None or value < best[0]:
            best = (value, balance)
    return None if best is None else best[1]


@st.composite
def problems(draw):
    n = draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["contiguous", "looped", "v"]))
    p = draw(st.integers(1, 4))
    v = 2 if kind == "v" else (draw(st.integers(1, 2)) if kind == "looped" else 1)
    s2r = {"contiguous": None, "looped": looped(p, v), "v": vshape(p)}[kind]
    if p * v > n:
        s2r, p, v = None, min(p, n), 1
    value = st.integers(0, 8) | st.sampled_from([0.25, 0.5, 1.5, 3.75])  # ties are common; floats exact
    costs = draw(st.lists(value, min_size=n, max_size=n))
    memory = draw(st.none() | st.lists(st.integers(0, 8), min_size=n, max_size=n))
    limit = draw(st.none() | st.integers(0, 30)) if memory is not None else None
    return costs, p * v, s2r, memory, limit


@settings(max_examples=400, derandomize=True)
@given(problems())
def test_equals_brute_force(problem):
    costs, num_stages, s2r, memory, limit = problem
    expected = brute_force(costs, num_stages, s2r, memory, limit)
    if expected is None:
        with pytest.raises(ValueError, match=r"memory_limit=\d+: no cut .* the smallest largest per-rank memory"):
            balance_by_time(costs, num_stages, s2r, memory, limit)
    else:  # ties="first": the lexicographically first of the best; "even": the same three values
        assert balance_by_time(costs, num_stages, s2r, memory, limit) == expected
        even = balance_by_time(costs, num_stages, s2r, memory, limit, ties="even")
        assert values(costs, even, s2r, memory) == values(costs, expected, s2r, memory)
        assert limit is None or max(rank_loads(memory, even, s2r)) <= limit
        if not several_per_rank(s2r):
            assert even == expected


def test_hand_examples_one_stage_per_rank_looped_and_v():
    assert balance_by_time([1, 1, 1, 10, 1, 1], 3) == (3, 1, 2)  # the heavy layer alone
    # looped, 2 ranks x 2: rank 0 holds stages 0 and 2; the best per-rank cut is not the best per-stage one
    costs = [4, 1, 1, 4, 1, 1]
    assert balance_by_time(costs, 4, looped(2, 2)) == (2, 2, 1, 1)  # stages 5, 5, 1, 1: ranks 6, 6
    assert rank_loads(costs, (1, 2, 1, 2), looped(2, 2)) == (8, 4)  # the best per-stage cut (4, 2, 4, 2)
    # V, 2 ranks: rank 0 holds the first and the last stage
    assert vshape(2) == (0, 1, 1, 0)
    assert balance_by_time([5, 1, 1, 1, 1, 5], 4, vshape(2)) == (1, 1, 3, 1)  # rank 0: 5 + 5, rank 1: 1 + 3


def test_memory_breaks_time_ties_then_earlier_cuts():
    costs = [1, 1, 1, 1]  # (2, 2) is the only best time for 2 stages; with 3 stages (1, 1, 2), (1, 2, 1), (2, 1, 1)
    assert balance_by_time(costs, 3) == (1, 1, 2)  # no memory: the earliest cuts
    assert balance_by_time(costs, 3, memory=[0, 0, 5, 5]) == (1, 2, 1)  # the two heavy layers apart: 5, 5
    assert balance_by_time(costs, 3, memory=[5, 5, 0, 0]) == (1, 1, 2)  # apart already: the earliest cuts
    assert balance_by_time(costs, 3, memory=[9, 0, 0, 0]) == (1, 1, 2)
    assert balance_by_time(costs, 3, memory=[0, 0, 0, 9]) == (1, 1, 2)
    # time first: a cut with less memory but a slower stage loses
    assert balance_by_time([1, 1, 2], 2, memory=[0, 0, 9]) == (2, 1)


def test_memory_limit_is_hard_and_time_comes_second_to_it():
    costs, memory = [1, 1, 1, 1], [4, 4, 1, 1]
    assert balance_by_time(costs, 2, memory=memory) == (2, 2)  # memory 8 | 2
    assert balance_by_time(costs, 2, memory=memory, memory_limit=6) == (1, 3)  # slower (3), within 6
    with pytest.raises(ValueError, match=r"memory_limit=3: no cut of the 4 layers into 2 stages keeps every rank "
                                         r"within it; the smallest largest per-rank memory of any cut is 6"):
        balance_by_time(costs, 2, memory=memory, memory_limit=3)


def test_deterministic_and_float_exact():
    costs = [0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1]  # 0.1 + 0.2 != 0.3 in floats; the sums are compared exactly
    first = balance_by_time(costs, 4, looped(2, 2), memory=[3.5] * 7)
    assert all(balance_by_time(costs, 4, looped(2, 2), memory=[3.5] * 7) == first for _ in range(3))
    assert first == brute_force(costs, 4, looped(2, 2), [3.5] * 7)


def test_ties_even_gives_even_stages_where_the_first_tie_does_not():
    # 96 layers, 8 ranks x 4 looped stages: every per-rank cut of load 13 ties on time, memory (layers) and the
    # slowest stage (the 4-unit last layer bounds it). The lexicographically first tie puts nine 1-layer stages
    # first and 4-layer stages after, on the same ranks (simulated, interleaved-1f1b, F = layers, B = 2F, m = 8:
    # 429 units); ties="even" gives even stages (387 units).
    costs, s2r, memory = [3.0] + [1.0] * 94 + [4.0], looped(8, 4), [1.0] * 96
    first = balance_by_time(costs, 32, s2r, memory=memory)
    even = balance_by_time(costs, 32, s2r, memory=memory, ties="even")
    assert first == (1,) * 9 + (2,) + (4,) * 21 + (1,)
    assert even == (1,) + (3,) * 23 + (4, 4, 4, 3, 4, 3, 3, 1)
    for balance in (first, even):
        assert max(rank_loads(costs, balance, s2r)) == 13 and max(rank_loads(memory, balance, s2r)) == 13
    # the other way round on a 6-layer model, 2 x 2 looped: two cuts that tie on all three values; the first
    # (small first stage) fills faster (see the simulation below); the planner met it with ties="even" on seconds
    small = [1, 4, 1, 1, 4, 1]
    assert balance_by_time(small, 4, looped(2, 2)) == (1, 2, 2, 1)
    assert values(small, (1, 2, 2, 1), looped(2, 2)) == values(small, (2, 1, 1, 2), looped(2, 2)) == (6, 0, 5)


def test_the_ties_choice_changes_the_simulated_step():
    import pipesched as ps

    def step(costs, balance, p, v, m):
        stage, start = [], 0
        for count in balance:
            stage.append(sum(costs[start:start + count]))
            start += count
        cost = ps.CostModel(forward=tuple(stage), backward=tuple(2 * x for x in stage))
        return ps.simulate(ps.compile_program("interleaved-1f1b", p, m, virtual_stages=v), cost).makespan

    costs = [3.0] + [1.0] * 94 + [4.0]
    first = balance_by_time(costs, 32, looped(8, 4), memory=[1.0] * 96)
    even = balance_by_time(costs, 32, looped(8, 4), memory=[1.0] * 96, ties="even")
    assert (step(costs, first, 8, 4, 8), step(costs, even, 8, 4, 8)) == (429.0, 387.0)
    small = [1.0, 4.0, 1.0, 1.0, 4.0, 1.0]
    assert (step(small, (1, 2, 2, 1), 2, 2, 8), step(small, (2, 1, 1, 2), 2, 2, 8)) == (163.0, 171.0)


@pytest.mark.parametrize("args, error, message", [
    (([1, 2], 3), ValueError, r"cannot cut 2 layers into num_stages=3 non-empty stages: valid num_stages is 1 \.\. 2"),
    (([1, 2], 0), ValueError, r"num_stages=0"),
    (([1, -2], 1), ValueError, r"layer_costs\[1\] must be a finite number >= 0, got -2"),
    (([1, float("nan")], 1), ValueError, r"layer_costs\[1\] must be a finite number >= 0, got nan"),
    (([1, float("inf")], 1), ValueError, r"layer_costs\[1\] .* got inf"),
    (([1, True], 1), ValueError, r"layer_costs\[1\] .* got True"),
    (("12", 1), ValueError, r"layer_costs must be a sequence of numbers"),
    (([1, 2], 1.0), TypeError, r"num_stages must be an int, got 1.0"),
    (([1, 2], 2, (0,)), ValueError, r"stage_to_rank=\[0\] must give a rank \(int >= 0\) for each of the 2 stages"),
    (([1, 2], 2, (0, -1)), ValueError, r"stage_to_rank=\[0, -1\]"),
    (([1, 2], 2, None, [1]), ValueError, r"memory has 1 values but layer_costs has 2"),
    (([1, 2], 2, None, None, 5), ValueError, r"memory_limit=5 needs memory"),
    (([1, 2], 2, None, [1, 1], -1), ValueError, r"memory_limit must be a finite number of bytes >= 0, got -1"),
    (([1, 2], 2, None, None, None, 0), ValueError, r"max_nodes must be None or an int >= 1, got 0"),
    (([1, 2], 2, None, None, None, 10, "lexicographic"), ValueError, r"ties must be 'first' or 'even', got "
                                                                     r"'lexicographic'"),
])
def test_bad_input_is_refused_naming_the_argument(args, error, message):
    with pytest.raises(error, match=message):
        balance_by_time(*args)


def test_balance_params_uses_the_same_partitioner():
    from pipesched.runtime.stage import min_max_partition  # balance="params" calls it
    assert min_max_partition([20, 20, 200], 2) == balance_by_time([20, 20, 200], 2) == (2, 1)


def test_max_nodes_bounds_the_search_and_stays_deterministic():
    costs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    exact = balance_by_time(costs, 6, looped(3, 2), max_nodes=None)
    assert exact == balance_by_time(costs, 6, looped(3, 2), max_nodes=10**6)
    capped = balance_by_time(costs, 6, looped(3, 2), max_nodes=1)  # the seeds only
    assert capped == balance_by_time(costs, 6, looped(3, 2), max_nodes=1) and sum(capped) == 20 and len(capped) == 6
    seed = balance_by_time(costs, 6)  # the best one-stage-per-rank cut is a seed: never worse than it
    assert max(rank_loads(costs, exact, looped(3, 2))) <= max(rank_loads(costs, capped, looped(3, 2))) \
        <= max(rank_loads(costs, seed, looped(3, 2)))


@settings(max_examples=150, derandomize=True)
@given(st.integers(2, 4).flatmap(lambda p: st.tuples(
    st.just(p), st.lists(st.integers(0, 20) | st.sampled_from([0.125, 2.5, 7.75]), min_size=2 * p, max_size=14))))
def test_v_placements_are_exact_beyond_the_small_cases(problem):
    # V placements (zbv, dualpipev) take partition_v's exact walk, not the capped search: the least slowest rank
    # on up to 14 layers and 4 ranks, against every cut
    p, costs = problem
    expected = brute_force(costs, 2 * p, vshape(p))
    assert balance_by_time(costs, 2 * p, vshape(p)) == expected
    capped = balance_by_time(costs, 2 * p, vshape(p), max_nodes=1)  # the ties' searches cut short, not the time
    assert values(costs, capped, vshape(p))[0] == values(costs, expected, vshape(p))[0]


def test_v_at_96_layers_reaches_the_least_slowest_rank():
    from pipesched.partition import _exact_prefixes
    from pipesched.partition_v import least_v_load

    # 96 GPT-like layers on 8 ranks in a V: the capped branch and bound found 117.4 (scaled) where 115.1 exists
    rng = __import__("random").Random(1)
    costs = [3.0] + [rng.uniform(0.7, 1.3) for _ in range(94)] + [4.0]
    C, _, _ = _exact_prefixes(costs, [0] * 96, None)
    least, cut = least_v_load(C, 8, C[96])
    balance = balance_by_time(costs, 16, vshape(8))
    assert max(rank_loads(costs, balance, vshape(8))) == max(rank_loads(costs, tuple(b - a for a, b in
                                                                                     zip(cut, cut[1:])), vshape(8)))
    assert least_v_load(C, 8, least - 1) is None  # one unit less (of the exact scale) is out of reach


def test_costs_of_any_scale_are_compared_exactly_without_overflow():
    # 1e-300 next to 1.0: the exact integers are ~2^1000 apart; the search's order works on ints, not floats
    assert balance_by_time([1e-300, 1.0] * 5, 4, vshape(2)) == (2, 2, 3, 3)
    assert max(rank_loads([1e-300, 1.0] * 5, balance_by_time([1e-300, 1.0] * 5, 4, looped(2, 2)), looped(2, 2))) \
        == pytest.approx(3.0)
