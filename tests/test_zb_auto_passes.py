"""zb-auto ranks its candidates as they will run: with the step's passes (recompute, data parallelism, ties) applied,
so compile_program("zb-auto", ...) is never slower in simulation than compile_program("zb-h1", ...) with the same
passes under the same costs (a trial found 15 s against 14 s with recompute, when candidates were scored bare)."""
from hypothesis import given, settings, strategies as st

import pipesched as ps
from pipesched.testing import cost_models


def test_the_trials_case_by_hand():
    costs = ps.CostModel(forward=1, backward=2, latency=0.5)
    auto = ps.compile_program("zb-auto", 2, 3, recompute=True, costs=costs)
    h1 = ps.compile_program("zb-h1", 2, 3, recompute=True)
    assert ps.simulate(h1, costs).makespan == 14.0
    assert ps.simulate(auto, costs).makespan == 14.0  # was 15.0


@settings(max_examples=60, deadline=None)
@given(data=st.data(), p=st.integers(2, 5), m=st.integers(1, 8), dp=st.integers(1, 3))
def test_never_slower_than_zb_h1_with_the_same_passes(data, p, m, dp):
    costs = data.draw(cost_models(p))
    recompute = data.draw(st.one_of(st.booleans(), st.lists(st.booleans(), min_size=p, max_size=p)))
    ties = [(0, p - 1)] if data.draw(st.booleans()) else []
    kwargs = dict(dp_size=dp, recompute=recompute, ties=ties)
    auto = ps.compile_program("zb-auto", p, m, costs=costs, **kwargs)
    h1 = ps.compile_program("zb-h1", p, m, **kwargs)
    assert ps.simulate(auto, costs).makespan <= ps.simulate(h1, costs).makespan * (1 + 1e-9)
