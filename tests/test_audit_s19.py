"""Public-API error and docstring gaps (audit s19): each refusal names the argument, its value and what is valid.

``rank_loads`` summed negative, NaN or infinite loads silently; the viz entry points given ``None`` for a Timeline
failed with an AttributeError deep inside; ``profile_layers`` passed on torch's raw error for a target of another
batch size; ``build("zb-auto", score="x")`` failed late with "'str' object is not callable";
``simulate(program_with_m0, check=False)`` divided by zero; some public properties had no docstring.
"""
import dataclasses
import math
import warnings

import pytest

import pipesched
from pipesched import CostModel, ScheduleArgumentError, compile_program, rank_loads, simulate
from pipesched.schedules.zb_auto import build_zb_auto


# ---- 1. rank_loads refuses loads that are no finite number >= 0 ------------------------------------------------

@pytest.mark.parametrize("values, index, shown", [
    ([1.0, -2.0, 3.0], 1, "-2.0"), ([1.0, 2.0, math.nan], 2, "nan"), ([math.inf, 1.0, 1.0], 0, "inf"),
    ([1.0, -math.inf, 1.0], 1, "-inf"), ([1, "2", 3], 1, "'2'"),
])
def test_rank_loads_refuses_a_negative_nan_or_infinite_load(values, index, shown):
    with pytest.raises(ValueError) as info:
        rank_loads(values, [1, 2])
    assert str(info.value) == f"values[{index}] must be a finite number >= 0, got {shown}"


def test_rank_loads_still_sums_valid_loads_exactly():
    from fractions import Fraction

    assert rank_loads([0, 2.5, 3], [1, 2]) == (0, 5.5)
    assert rank_loads([Fraction(1, 3)] * 3, [1, 2]) == (Fraction(1, 3), Fraction(2, 3))  # not turned to floats


# ---- 2. the viz entry points name a Timeline that is none ----------------------------------------------------

def _viz_calls(timeline, tmp_path):
    """(what the message starts with, argument name, call) of every public viz function that takes a Timeline."""
    from pipesched import viz

    return [
        ("plot_timeline", "timeline", lambda: viz.plot_timeline(None)),
        ("to_chrome_trace", "timeline", lambda: viz.to_chrome_trace(None)),
        ("save_chrome_trace", "timeline", lambda: viz.save_chrome_trace(None, tmp_path / "t.json")),
        ("save_chrome_trace", "timeline", lambda: viz.write_chrome_trace(None, tmp_path / "t.json")),
        ("plot_comparison", "simulated", lambda: viz.plot_comparison(None, timeline)),
        ("plot_comparison", "measured", lambda: viz.plot_comparison(timeline, None)),
        ("predict_for", "measured", lambda: viz.predict_for(None)),
        ("fit_cost", "measured", lambda: viz.fit_cost(None)),
        ("simulate_like", "measured", lambda: viz.simulate_like(compile_program("1f1b", 2, 2), None)),
        ("bubble_breakdown", "timeline", lambda: viz.bubble_breakdown(None)),
        ("communication_waits", "timeline", lambda: viz.communication_waits(None)),
        ("send_intervals", "timeline", lambda: viz.send_intervals(None)),
        ("send_seconds", "timeline", lambda: viz.send_seconds(None)),
    ]


def test_every_public_viz_function_names_a_timeline_that_is_none(tmp_path):
    pytest.importorskip("matplotlib")
    timeline = simulate(compile_program("1f1b", 2, 2))
    calls = _viz_calls(timeline, tmp_path)
    from pipesched import viz

    takes_timeline = {"plot_timeline", "to_chrome_trace", "save_chrome_trace", "write_chrome_trace",
                      "plot_comparison", "predict_for", "fit_cost", "simulate_like", "bubble_breakdown",
                      "communication_waits", "send_intervals", "send_seconds"}
    others = {"plot_bubble_vs_microbatches", "closed_form_bubble", "build_gallery"}  # no Timeline argument
    assert set(viz.__all__) == takes_timeline | others  # a new export is added to one of the two sets
    for where, name, call in calls:
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == f"{where}: {name} must be a pipesched.Timeline, got NoneType None"
    assert not (tmp_path / "t.json").exists()  # refused before the file is opened


def test_a_timeline_of_another_type_is_named_with_its_type():
    from pipesched.viz.trace import to_chrome_trace

    with pytest.raises(TypeError) as info:
        to_chrome_trace({"events": []})
    assert str(info.value) == "to_chrome_trace: timeline must be a pipesched.Timeline, got dict {'events': []}"


# ---- 3. profile_layers names a target whose batch size is not the output's -------------------------------------

@pytest.mark.parametrize("loss_name, target_shape, raised", [
    ("cross_entropy", (3,), "ValueError"), ("mse_loss", (3, 2), "RuntimeError"),
])
def test_profile_layers_names_a_target_of_another_batch_size(loss_name, target_shape, raised):
    torch = pytest.importorskip("torch")
    from pipesched.runtime.profiling import profile_layers

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    target = torch.zeros(target_shape, dtype=torch.long if loss_name == "cross_entropy" else torch.float32)
    with warnings.catch_warnings(), pytest.raises(ValueError) as info:
        warnings.simplefilter("ignore")  # mse_loss's broadcast warning, the intra-op threads' one
        profile_layers(model, torch.randn(4, 3), target=target, loss_fn=getattr(torch.nn.functional, loss_name),
                       repeat=1, warmup=0)
    assert str(info.value) == (
        f"profile_layers: target has shape {target_shape} but the model's output has shape (4, 2): their first "
        f"(batch) dimensions differ (3 vs 4), and loss_fn raised {raised}; pass the target of the sample (one row "
        f"per sample_input row)")
    assert type(info.value.__cause__).__name__ == raised  # torch's own error kept


def test_profile_layers_passes_on_a_loss_error_that_is_not_about_the_batch():
    torch = pytest.importorskip("torch")
    from pipesched.runtime.profiling import profile_layers

    def loss_fn(output, target):
        raise RuntimeError("the loss's own fault")

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="^the loss's own fault$"):
        warnings.simplefilter("ignore")
        profile_layers(model, torch.randn(4, 3), target=torch.zeros(4, 2), loss_fn=loss_fn, repeat=1, warmup=0)


# ---- 4. zb-auto's score must be callable or None --------------------------------------------------------------

@pytest.mark.parametrize("score, shown", [("x", "str 'x'"), (0, "int 0"), (1.5, "float 1.5")])
def test_build_refuses_a_score_that_is_not_callable(score, shown):
    with pytest.raises(TypeError) as info:
        pipesched.build("zb-auto", 2, 4, score=score)
    assert str(info.value) == f"build: score must be callable or None (the default: simulated_makespan), got {shown}"
    with pytest.raises(TypeError) as info:
        build_zb_auto(2, 4, score=score)
    assert str(info.value) == f"zb-auto: score must be callable or None (the default: timed_makespan), got {shown}"


def test_build_zb_auto_still_takes_a_callable_score_and_none():
    seen = []

    def score(program, costs):
        seen.append(program)
        return float(len(seen))  # the first candidate scored wins

    assert pipesched.build("zb-auto", 2, 4, score=score).num_microbatches == 4 and seen
    assert pipesched.build("zb-auto", 2, 4, score=None).num_microbatches == 4


# ---- 5. simulate(check=False) of a program with m=0 -----------------------------------------------------------

@pytest.mark.parametrize("field, value", [("num_microbatches", 0), ("num_microbatches", -1), ("dp_size", 0)])
def test_simulate_unchecked_names_a_count_below_one(field, value):
    program = dataclasses.replace(compile_program("1f1b", 2, 2), **{field: value})
    for run in (lambda: simulate(program, check=False), lambda: pipesched.sim.makespan(program, check=False)):
        with pytest.raises(ScheduleArgumentError) as info:
            run()
        assert str(info.value) == (f"simulate(check=False): the program's {field} must be an integer >= 1, "
                                   f"got {value}")
        assert isinstance(info.value, ValueError) and info.value.argument == field


def test_simulate_unchecked_still_runs_a_valid_program():
    program = compile_program("1f1b", 2, 2)
    assert simulate(program, CostModel(), check=False).makespan == simulate(program).makespan


# ---- 6. docstrings of public properties -----------------------------------------------------------------------

def test_public_properties_have_docstrings():
    from pipesched import Event, LayerProfile, Plan, Program, Timeline

    documented = [Event.duration, Program.num_ranks, Program.num_stages, Plan.best, Timeline.from_json_dict,
                  LayerProfile.num_layers, LayerProfile.to_json]
    assert [thing for thing in documented if not (thing.__doc__ or "").strip()] == []


def test_build_refuses_a_score_for_a_schedule_that_does_not_rank_candidates():
    with pytest.raises(ScheduleArgumentError) as info:
        pipesched.build("1f1b", 2, 4, score=lambda program, costs: 0.0)
    assert str(info.value).startswith("score=<function ")
    assert str(info.value).endswith(": schedule '1f1b' does not take score; only schedules built from costs do "
                                    "(zb-auto)")
    assert info.value.argument == "score"
