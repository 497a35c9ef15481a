"""Simulated vs measured: fitted costs, prediction, the two-panel picture with both bubbles."""
import re

import pytest

from pipesched import CostModel, Timeline, compile_program, simulate
from pipesched.viz.compare import fit_cost, plot_comparison, predict_for

from viz_support import sim

COST = CostModel(forward=[1.1e-3, 1.0e-3, 1.4e-3, 1.0e-3], backward=[2.3e-3, 2.0e-3, 2.9e-3, 2.1e-3], latency=1.5e-4)


def as_measured(timeline, drop=("cost",)):
    meta = {k: v for k, v in timeline.meta.items() if k not in drop}
    return Timeline(timeline.events, timeline.num_ranks, source="measured", meta=meta)


def test_fit_cost_reads_per_stage_means_and_latency():
    _, timeline = sim("1f1b", 4, 8, cost=COST)
    fitted = fit_cost(as_measured(timeline))
    assert fitted.forward == pytest.approx([1.1e-3, 1.0e-3, 1.4e-3, 1.0e-3])
    assert fitted.backward == pytest.approx([2.3e-3, 2.0e-3, 2.9e-3, 2.1e-3])
    assert fitted.latency == pytest.approx(1.5e-4)


def test_prediction_of_a_run_with_fitted_costs_reproduces_it():
    _, timeline = sim("interleaved-1f1b", 4, 8, 2, cost=CostModel(forward=1e-3, backward=2e-3, latency=1e-4),
                      recompute=True)
    predicted = predict_for(as_measured(timeline))
    assert predicted.source == "simulated"
    assert predicted.bubble_fraction == pytest.approx(timeline.bubble_fraction)
    assert predicted.makespan == pytest.approx(timeline.makespan)


def test_prediction_of_a_split_backward_run_splits_the_same_stages():
    cost = CostModel(forward=1e-3, backward=2e-3, input_grad=0.8e-3, weight_grad=1.2e-3, latency=2e-4)
    program, timeline = sim("1f1b", 2, 4, cost=cost, split_backward=True)
    predicted = predict_for(as_measured(timeline))
    assert sorted({str(e.instr.op) for e in predicted.events if e.rank == 1}) == ["F", "I", "RECV_F", "SEND_B", "W"]
    assert predicted.makespan == pytest.approx(timeline.makespan)


def test_predict_needs_the_schedule_in_meta():
    _, timeline = sim("1f1b", 2, 2)
    with pytest.raises(ValueError, match="schedule"):
        predict_for(as_measured(timeline, drop=("schedule",)))


@pytest.mark.parametrize("mode", ["side-by-side", "overlay"])
def test_comparison_draws_both_timelines_and_both_bubbles(mode):
    _, measured = sim("1f1b", 4, 8, cost=COST)
    measured = as_measured(measured)
    predicted = predict_for(measured, CostModel(forward=1e-3, backward=2e-3))
    fig = plot_comparison(predicted, measured, mode=mode)
    gids = [p.get_gid() or "" for ax in fig.axes for p in ax.patches]
    assert sum(g.startswith("predicted:compute:") for g in gids) == 64
    assert sum(g.startswith("measured:compute:") for g in gids) == 64
    head = fig._suptitle.get_text()
    found = re.search(r"measured bubble (\d+\.\d+)%\s+vs\s+predicted (\d+\.\d+)%", head)
    assert float(found.group(1)) == round(100 * measured.bubble_fraction, 2)
    assert float(found.group(2)) == 27.27  # uniform 1f1b prediction: 3/11
    bars = {p.get_gid() for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("breakdown")}
    assert bars == {"breakdown:predicted", "breakdown:measured"}


def test_comparison_rejects_mismatch_and_unknown_mode(measured):
    _, other = sim("1f1b", 4, 8)
    with pytest.raises(ValueError, match="same ranks"):
        plot_comparison(other, measured)
    with pytest.raises(ValueError, match="mode"):
        plot_comparison(measured, measured, mode="stacked")


def test_package_exports_what_the_training_example_uses(tmp_path):
    import json

    from pipesched import compile_program
    from pipesched.viz import plot_comparison as exported, simulate_like, write_chrome_trace

    program = compile_program("1f1b", 4, 8)
    _, measured = sim("1f1b", 4, 8, cost=COST)
    measured = as_measured(measured)
    predicted = simulate_like(program, measured)
    assert predicted.bubble_fraction == pytest.approx(measured.bubble_fraction)
    assert exported is plot_comparison
    write_chrome_trace(measured, tmp_path / "t.json")
    assert len([e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]) == len(program)


def test_prediction_refuses_a_one_rank_timeline():
    _, timeline = sim("1f1b", 2, 4, cost=CostModel(forward=1e-3, backward=2e-3))
    one = Timeline(tuple(e for e in timeline.events if e.rank == 1), 2, "measured", dict(timeline.meta), ranks=(1,))
    with pytest.raises(ValueError, match=r"holds ranks \[1\] of 2; a prediction needs every rank's costs: save "
                                         r"Pipeline.gather_timeline\(\), not .timeline\(\)"):
        predict_for(one)


def test_a_forward_timeline_is_predicted_with_the_forward_only_program():
    program = compile_program("1f1b", 2, 4, forward_only=True)
    timeline = simulate(program, CostModel(forward=[1e-3, 2e-3], backward=2e-3, latency=1e-4))
    predicted = predict_for(as_measured(timeline))  # its meta says step: forward
    assert predicted.meta["step"] == "forward" and predicted.peak_inflight == (0, 0)
    assert [(e.rank, e.instr) for e in predicted.events] == [(e.rank, e.instr) for e in timeline.events]
    assert predicted.makespan == pytest.approx(timeline.makespan)
