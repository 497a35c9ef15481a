"""zb-auto in Pipeline on 2 ranks, built from given costs: losses equal, gradients and parameters bitwise the
unsplit model's after AdamW steps (m = 4 and m = 8 on an uneven batch)."""
import pytest

from pipesched.runtime import launch

import rt_zb_auto


@pytest.fixture(scope="module")
def results():
    return launch(rt_zb_auto.suite, 2, timeout=300)


@pytest.mark.parametrize("m", [4, 8])
def test_two_ranks_bitwise(results, m):
    for res in results:
        case = res[m]
        for step in case["steps"]:
            assert step["loss_equal"] is True and step["bitwise"] is True and step["grads"] > 0, case
        assert case["params_equal"] is True, case
        assert {"I", "W"} <= set(case["ops"]) and "B" not in case["ops"], case["ops"]
        assert case["chosen"].startswith("greedy-"), case["chosen"]  # the greedy's own program ran
        assert max(case["peak"]) <= 3
