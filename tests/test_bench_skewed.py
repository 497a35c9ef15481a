"""The skewed models of benchmarks/bench_plan.py (issue 14: balance="time" vs balance=None): the cuts each balance
gives and what the planner predicts for them, from a hand profile shaped like the measured one (per layer F + I + W:
width 1024 3.6 ms, width 64 0.45 ms, the first layer without an input gradient). No timing."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipesched.planner import predict
from pipesched.profile import LayerProfile

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_plan.py"
MS = 1e-3


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_plan_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hand_profile(widths, model) -> LayerProfile:
    """Forward a third of a layer's time, input and weight gradient a third each; layer 0 has no input gradient."""
    third = [(3.6 if w == 1024 else 0.45) * MS / 3 for w in widths]
    n = len(widths)
    rows = 64
    return LayerProfile(forward=third, input_grad=[0.0] + third[1:], weight_grad=third,
                        activation_bytes=[rows * (2 * w + 256) * 4.0 for w in widths],
                        output_bytes=[rows * 256 * 4.0] * n, param_bytes=[(2 * 256 * w + w + 256) * 4.0 for w in widths],
                        microbatch_size=rows, input_bytes=rows * 256 * 4.0, latency=1e-4, bandwidth=3.5e9,
                        layer_names=[type(layer).__name__ for layer in model])


@pytest.mark.parametrize("name, time_cut", [("4 of width 64, then 4 of 1024", (6, 2)),
                                            ("3 of width 1024, then 5 of 64", (2, 6))])
def test_cuts_and_predicted_ratio(bench, name, time_cut):
    from pipesched.runtime.stage import resolve_balance

    widths = bench.SKEWED[name]
    model = bench.skewed_model(widths)
    assert [block[0].out_features for block in model] == list(widths)
    profile = hand_profile(widths, model)
    even = resolve_balance(list(model), 2)
    assert even == (4, 4)
    assert resolve_balance(list(model), 2, "time", profile) == time_cut
    wide = {i for i, w in enumerate(widths) if w == 1024}
    assert wide <= set(range(4)) or wide <= set(range(4, 8))  # the even cut: every wide layer on one rank
    assert any(i < time_cut[0] for i in wide) and any(i >= time_cut[0] for i in wide)  # the time cut splits them
    step = {cut: predict(profile, 512, schedule="1f1b", pp=2, num_microbatches=8, balance=cut).step_time
            for cut in (time_cut, even)}
    assert step[time_cut] / step[even] < 0.8


def test_default_model_unchanged(bench):
    """``skewed_model()`` without widths is the model the benchmark measured before (3 wide, then 5 narrow)."""
    assert [block[0].out_features for block in bench.skewed_model()] == [1024] * 3 + [64] * 5
