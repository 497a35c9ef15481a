"""Tied parameters with data parallelism, DP=2 x PP=2 on 4 ranks: each tied gradient is the average over replicas of
the sum over its uses (the unsplit model's, data-parallel), within rtol 1e-5, atol 1e-6; untied, first step: bitwise."""
import pytest

from pipesched.runtime import launch

import rt_tied

KEYS = [("1f1b", "plain", "adamw"), ("interleaved-1f1b", "split", "sgd")]


@pytest.fixture(scope="module")
def results():
    return launch(rt_tied.dp_suite, 4, timeout=300)


@pytest.mark.parametrize("key", KEYS, ids=["-".join(k) for k in KEYS])
def test_dp_tied_gradients_average_the_replicas_and_all_four_copies_agree(results, key):
    for res in results:
        case = res[key]
        assert [s["close"] for s in case["steps"]] == [True] * 3, case
        assert case["steps"][0]["untied_exact"] is True, case  # later steps start from weights a rounding apart
        assert case["weights_close"] is True
    for step in range(3):
        copies = [res[key]["steps"][step]["copies"] for res in results]
        assert all(c == copies[0] for c in copies) and len(copies[0]) == 2, copies  # every rank, both replicas
