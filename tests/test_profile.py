"""LayerProfile: validation, per-stage costs of a balance, check_model, scaling and the JSON round trip."""
import json
import math

import pytest

from pipesched.profile import LayerProfile


def profile(**changes):
    fields = dict(forward=(1.0, 2.0, 3.0), input_grad=(0.5, 1.0, 1.5), weight_grad=(0.0, 1.0, 2.0),
                  activation_bytes=(10.0, 20.0, 30.0), output_bytes=(4.0, 8.0, 2.0), param_bytes=(0.0, 100.0, 200.0),
                  microbatch_size=2, input_bytes=6.0, latency=0.25, bandwidth=1000.0,
                  layer_names=("ReLU", "Linear", "Linear"))
    fields.update(changes)
    return LayerProfile(**fields)


def test_costs_of_a_balance_by_hand():
    costs = profile().costs([1, 2])
    assert costs.forward == (1.0, 5.0)
    assert costs.input_grad == (0.5, 2.5) and costs.weight_grad == (0.0, 3.0) and costs.backward == (0.5, 5.5)
    assert costs.recompute == (1.0, 5.0)
    assert costs.stash_bytes == (10.0, 50.0)
    assert costs.activation_bytes == (4.0, 2.0)  # the message: the stage's last layer's output
    assert costs.input_bytes == (6.0, 4.0)  # the model's input, then the previous stage's message
    assert costs.grad_bytes == (0.0, 300.0)
    assert costs.latency == 0.25 and costs.bandwidth == 1000.0
    assert profile().layer_seconds() == (1.5, 4.0, 6.5)


@pytest.mark.parametrize("balance, message", [
    ([1, 1], r"balance=\[1, 1\] sums to 2 but the profile has 3 layers"),
    ([0, 3], r"balance must be a sequence of layer counts >= 1, got \[0, 3\]"),
    ("12", r"balance must be a sequence of layer counts"),
])
def test_costs_refuses_a_bad_balance(balance, message):
    with pytest.raises(ValueError, match=message):
        profile().costs(balance)


@pytest.mark.parametrize("changes, message", [
    (dict(forward=()), r"LayerProfile.forward is empty"),
    (dict(input_grad=(1.0,)), r"LayerProfile.input_grad has 1 values but forward has 3"),
    (dict(weight_grad=(0.0, -1.0, 0.0)), r"LayerProfile.weight_grad\[1\] must be a finite number >= 0"),
    (dict(output_bytes=(0.0, math.nan, 0.0)), r"LayerProfile.output_bytes\[1\] .* got nan"),
    (dict(microbatch_size=0), r"LayerProfile.microbatch_size must be an int >= 1, got 0"),
    (dict(bandwidth=0.0), r"LayerProfile.bandwidth must be bytes/s > 0"),
    (dict(latency=-1.0), r"LayerProfile.latency must be a finite number >= 0"),
    (dict(layer_names=("A",)), r"LayerProfile.layer_names has 1 names but there are 3 layers"),
])
def test_validation_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        profile(**changes)


def test_check_model_refuses_another_model():
    profile().check_model(3, ["ReLU", "Linear", "Linear"])
    with pytest.raises(ValueError, match=r"profile has 3 layers but the model has 4: the profile is of another "
                                         r"model \(profile the model with pipesched.runtime.profile_layers\)"):
        profile().check_model(4)
    with pytest.raises(ValueError, match=r"profile's layer 1 is a Linear but the model's is a Conv2d"):
        profile().check_model(3, ["ReLU", "Conv2d", "Linear"])


def test_scaled_keeps_parameters_and_scales_the_rest():
    half = profile(microbatch_size=4).scaled(2)
    assert half.forward == (0.5, 1.0, 1.5) and half.activation_bytes == (5.0, 10.0, 15.0)
    assert half.param_bytes == (0.0, 100.0, 200.0) and half.input_bytes == 3.0 and half.microbatch_size == 2
    with pytest.raises(ValueError, match=r"microbatch_size must be an int >= 1, got 0"):
        profile().scaled(0)


def test_save_load_round_trip(tmp_path):
    for p in (profile(), profile(bandwidth=math.inf, latency=0.0, layer_names=())):
        p.save(tmp_path / "p.json")
        assert LayerProfile.load(tmp_path / "p.json") == p
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match=r"bad.json: not a pipesched LayerProfile"):
        LayerProfile.load(tmp_path / "bad.json")


def test_scaled_is_affine_with_fixed_parts():
    p = profile(microbatch_size=4, forward_fixed=(0.2, 0.0, 1.0), input_grad_fixed=(0.5, 0.2, 0.3),
                weight_grad_fixed=(0.0, 0.4, 2.0))
    one = p.scaled(1)  # fixed + (t - fixed) x 1/4, to rounding (rel 1e-12: the sums differ in the last bit)
    assert one.forward == pytest.approx((0.2 + 0.8 / 4, 2.0 / 4, 1.0 + 2.0 / 4), rel=1e-12)
    assert one.input_grad == pytest.approx((0.5, 0.2 + 0.8 / 4, 0.3 + 1.2 / 4), rel=1e-12)
    assert one.weight_grad == pytest.approx((0.0, 0.4 + 0.6 / 4, 2.0), rel=1e-12)
    assert one.activation_bytes == (2.5, 5.0, 7.5) and one.input_bytes == 1.5  # bytes: in proportion
    assert one.forward_fixed == p.forward_fixed and one.param_bytes == p.param_bytes
    eight = p.scaled(8)  # and beyond the profiled size, the same line
    assert eight.forward == pytest.approx((0.2 + 0.8 * 2, 4.0, 1.0 + 2.0 * 2), rel=1e-12)
    twice = p.scaled(2).scaled(1)  # scaling twice is scaling once
    assert twice.forward == pytest.approx(one.forward, rel=1e-12)
    assert twice.weight_grad == pytest.approx(one.weight_grad, rel=1e-12)
    assert p.scaled(4) is p
    assert profile().forward_fixed == (0.0, 0.0, 0.0)  # no fixed parts: all 0, time in proportion


@pytest.mark.parametrize("changes, message", [
    (dict(forward_fixed=(0.0, 2.5, 0.0)), r"LayerProfile.forward_fixed\[1\] = 2.5 s exceeds forward\[1\] = 2.0 s"),
    (dict(weight_grad_fixed=(0.0, -0.1, 0.0)), r"LayerProfile.weight_grad_fixed\[1\] must be a finite number >= 0"),
    (dict(input_grad_fixed=(0.1,)), r"LayerProfile.input_grad_fixed has 1 values but there are 3 layers"),
])
def test_fixed_parts_are_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        profile(**changes)


def test_round_trip_with_fixed_parts_and_an_old_file(tmp_path):
    p = profile(forward_fixed=(0.5, 1.0, 0.0), weight_grad_fixed=(0.0, 0.25, 2.0))
    p.save(tmp_path / "p.json")
    assert LayerProfile.load(tmp_path / "p.json") == p
    old = p.to_json()
    for name in ("forward_fixed", "input_grad_fixed", "weight_grad_fixed"):
        del old[name]  # a profile saved before the fixed parts existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = LayerProfile.load(tmp_path / "old.json")
    assert loaded == profile() and loaded.weight_grad_fixed == (0.0, 0.0, 0.0)
    assert loaded.scaled(1).forward == (0.5, 1.0, 1.5)  # proportional, as before
