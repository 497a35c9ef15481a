"""Recompute replays a layer's draws from Python's ``random`` and NumPy's global generator (runtime/recompute.py,
``host_states``): before, R drew new numbers, so backward differentiated another function than F computed, and
R advanced the streams, so later forwards drew differently: loss 1.2134 plain vs 1.2849 recomputed, gradient
differences as large as the gradients (a hunt's finding). 2 ranks; each case trains 2 steps from the same seeds
with and without recompute (rt_recompute_host_rng.py)."""
from __future__ import annotations

import pytest

from pipesched.runtime import launch

import rt_recompute_host_rng

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results():
    return launch(rt_recompute_host_rng.compare, 2, timeout=300)


@pytest.mark.parametrize("case", ["1f1b", "zbv", "1f1b+split"])
def test_a_recomputed_run_equals_the_plain_one_with_host_random_draws(results, case):
    for rank, res in enumerate(results):
        assert res[case] == {"losses": True, "grads": True, "streams": True}, (rank, case, res[case])
