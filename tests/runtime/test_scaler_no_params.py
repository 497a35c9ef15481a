"""GradScaler (float16) on a pipeline where some ranks hold no parameters: README's loop with ``opt = None`` on
such a rank (``scaler.unscale_(None)``, ``scaler.step(None)``) joins the overflow vote, so every rank skips
together and keeps the reference's scale; weights bitwise those of the unsplit model with torch.amp.GradScaler;
None on a rank with parameters is refused (update() alone there ends every rank:
test_one_rank_fault_collectives.py). pp=2 x dp=2 and interleaved-1f1b on 4 ranks (ranks 1 and 3 hold only Tanh
stages). 4 spawned gloo ranks."""
import pytest

from pipesched.runtime import launch

import rt_scaler_no_params

pytestmark = pytest.mark.multiprocess

#: the reference's scale after each of the 4 steps: init 1024, growth interval 2, overflow (Boom) in step 2
SCALES = [1024.0, 512.0, 512.0, 1024.0]


@pytest.fixture(scope="module")
def results():
    return launch(rt_scaler_no_params.suite, rt_scaler_no_params.WORLD, timeout=300)


@pytest.mark.parametrize("paramless", ["none", "step only"])
@pytest.mark.parametrize("layout", list(rt_scaler_no_params.LAYOUTS))
def test_every_rank_runs_the_loop_and_agrees_on_the_scale(results, layout, paramless):
    empty = {"pp2xdp2": {1, 3}, "pp4-interleaved": {1, 3}}[layout]
    for rank, res in enumerate(results):
        case = res[(layout, paramless)]
        assert (case["params"] == 0) == (rank in empty), (rank, case["params"])
        for step, row in enumerate(case["steps"], start=1):
            assert row["scale"] == row["ref_scale"] == SCALES[step - 1], (rank, step, row)
            assert row["weights"] is True, (rank, step, row)
            if rank not in empty:
                assert row["skipped"] is (step == 2), (rank, step, row)
        assert case["errors"] == [], (rank, case["errors"])


def test_none_on_a_rank_holding_parameters_is_refused_on_every_rank(results):
    for res in results:
        err = res["misuse"]
        assert err != "no error"
        assert err["rank"] == 0, err
        assert ("ValueError: scaler: optimizer=None on pipeline rank 0, which holds 2 parameter(s) with gradients; "
                "None is for a rank without parameters: pass this rank's optimizer") in err["cause"], err
