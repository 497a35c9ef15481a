"""LayerProfile.boundary_saves: a tensor that several layers of one stage save counts once in the stage's stash,
input and recompute bytes by hand, scaling, JSON (old files: no correction) and validation. Torch-free."""
import json

import pytest

from pipesched import compile_program
from pipesched.memory import peak_activation_bytes
from pipesched.profile import LayerProfile


def tanh_stack():
    """Linear, Tanh, Linear, Tanh, Linear, Tanh at 64 B a tensor: a Linear saves its input, a Tanh its output
    (the next Linear's input: the same tensor)."""
    return LayerProfile(forward=(1.0,) * 6, input_grad=(1.0,) * 6, weight_grad=(1.0, 0.0) * 3,
                        activation_bytes=(64.0,) * 6, output_bytes=(64.0,) * 6, param_bytes=(8.0, 0.0) * 3,
                        microbatch_size=4, input_bytes=64.0,
                        boundary_saves=((0, 0, ((0, 64.0),)),            # the model's input: layer 0 saves it
                                        (2, 2, ((1, 64.0), (2, 64.0))),  # Tanh 1's output = Linear 2's input
                                        (4, 4, ((3, 64.0), (4, 64.0)))))


@pytest.mark.parametrize("balance, stash, held", [
    ([3, 3], (128.0, 128.0), (128.0, 192.0)),  # stage 1 starts at Tanh 3: saves its output, not its input
    ([2, 4], (128.0, 192.0), (128.0, 192.0)),  # stage 1 starts at Linear 2: it saves its input (Tanh 1's output)
    ([1, 5], (64.0, 192.0), (64.0, 256.0)),
    ([2, 2, 2], (128.0, 128.0, 128.0), (128.0, 128.0, 128.0)),
    ([6], (256.0,), (256.0,)),
    ([1] * 6, (64.0,) * 6, (64.0, 128.0, 64.0, 128.0, 64.0, 128.0)),
])
def test_a_tensor_two_layers_save_counts_once(balance, stash, held):
    costs = tanh_stack().costs(balance)
    assert costs.stash_bytes == stash
    assert costs.input_bytes == (64.0,) * len(balance)  # the stage input as it is: not capped at the stash
    assert costs.recompute_bytes == held  # the input plus the stash, what the stage saves of the input once


def chain():
    """ReLU (saves its output X, 32 B), Flatten (a view of X at X's address: passes it on, saves nothing),
    Linear (saves X again, as its input), Dropout (saves an 8 B mask, not its new 32 B output), Linear (saves
    that output)."""
    return LayerProfile(forward=(1.0,) * 5, input_grad=(1.0,) * 5, weight_grad=(0.0,) * 5,
                        activation_bytes=(32.0, 0.0, 32.0, 8.0, 32.0), output_bytes=(32.0,) * 5,
                        param_bytes=(0.0,) * 5, microbatch_size=2, input_bytes=32.0,
                        boundary_saves=((1, 2, ((0, 32.0), (2, 32.0))), (4, 4, ((4, 32.0),))))


@pytest.mark.parametrize("balance, stash, held", [
    ([5], (72.0,), (104.0,)),  # ReLU does not save its input: a recompute holds it on top
    ([1, 4], (32.0, 72.0), (64.0, 72.0)),  # stage 1's input (X) is saved by its Linear: held once
    ([2, 3], (32.0, 72.0), (64.0, 72.0)),  # input X again (passed on by Flatten)
    ([3, 2], (32.0, 40.0), (64.0, 72.0)),  # ReLU and Linear both in stage 0 (not adjacent): X once
    ([1, 1, 3], (32.0, 0.0, 72.0), (64.0, 32.0, 72.0)),
    ([4, 1], (40.0, 32.0), (72.0, 32.0)),
])
def test_a_tensor_passed_on_by_a_view_counts_once_in_a_stage(balance, stash, held):
    costs = chain().costs(balance)
    assert costs.stash_bytes == stash and costs.recompute_bytes == held


def test_unequal_saves_of_one_tensor_count_the_most():
    # layer 1 saves 10 B at the tensor's address (a view of its first rows), layer 2 all 40 B: in a stage 40
    p = LayerProfile(forward=(1.0,) * 3, input_grad=(1.0,) * 3, weight_grad=(0.0,) * 3,
                     activation_bytes=(0.0, 10.0, 50.0), output_bytes=(40.0,) * 3, param_bytes=(0.0,) * 3,
                     microbatch_size=1, input_bytes=40.0, boundary_saves=((1, 2, ((1, 10.0), (2, 40.0))),))
    assert p.costs([3]).stash_bytes == (50.0,)  # 10 + 50 - min: the larger save holds the smaller
    assert p.costs([3]).recompute_bytes == (40.0 + 50.0,)  # the tensor is layer 0's output, not the input
    assert p.costs([1, 2]).stash_bytes == (0.0, 50.0)


def test_without_boundary_saves_the_old_sums():
    old = LayerProfile(**{**_fields(tanh_stack()), "boundary_saves": None})
    costs = old.costs([3, 3])
    assert costs.stash_bytes == (192.0, 192.0)  # summed per layer
    assert costs.input_bytes == (64.0, 64.0) and costs.recompute_bytes is None  # CostModel's default
    empty = LayerProfile(**{**_fields(tanh_stack()), "boundary_saves": ()})  # known: nothing passed is saved
    assert empty.costs([3, 3]).stash_bytes == (192.0, 192.0)
    assert empty.costs([3, 3]).recompute_bytes == (256.0, 256.0)  # input + stash: no save of the input


def test_predicted_peak_uses_the_deduplicated_stash():
    program = compile_program("1f1b", 2, 4)
    costs = tanh_stack().costs([3, 3])
    assert peak_activation_bytes(program, costs) == (2 * 128.0, 128.0)  # rank 0: 2 microbatches in flight
    redo = compile_program("1f1b", 2, 4, recompute=True)
    assert peak_activation_bytes(redo, costs) == (64.0 + 128.0, 192.0)  # one input held, then one R


@pytest.mark.parametrize("k", [1, 2, 8])
def test_scaled_scales_the_shared_bytes(k):
    p = tanh_stack()
    scaled = p.scaled(k)
    r = k / 4  # a power of two: exact
    assert scaled.boundary_saves == tuple((f, l, tuple((i, b * r) for i, b in s)) for f, l, s in p.boundary_saves)
    for balance in ([3, 3], [2, 4], [1, 2, 3]):
        a, b = scaled.costs(balance), p.costs(balance)
        assert a.stash_bytes == tuple(v * r for v in b.stash_bytes)
        assert a.recompute_bytes == tuple(v * r for v in b.recompute_bytes)
        assert a.input_bytes == tuple(v * r for v in b.input_bytes)
    assert scaled.scaled(4) == p


def test_json_round_trip_and_an_old_file(tmp_path):
    p = tanh_stack()
    p.save(tmp_path / "p.json")
    assert LayerProfile.load(tmp_path / "p.json") == p
    assert json.loads((tmp_path / "p.json").read_text())["version"] == 1  # an optional field: same version
    old = p.to_json()
    del old["boundary_saves"]  # a profile saved before the field existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = LayerProfile.load(tmp_path / "old.json")
    assert loaded.boundary_saves is None and loaded.costs([3, 3]).stash_bytes == (192.0, 192.0)
    unknown = LayerProfile(**{**_fields(p), "boundary_saves": None})
    unknown.save(tmp_path / "u.json")
    assert LayerProfile.load(tmp_path / "u.json") == unknown


@pytest.mark.parametrize("saves, message", [
    (((0, 6, ((0, 1.0),)),), r"boundary_saves\[0\]: first, last = 0, 6 must be layers with 0 <= first <= last < 6"),
    (((2, 2, ((0, 1.0),)),), r"boundary_saves\[0\]: layers \[0\] must be distinct, increasing and in 1 .. 2"),
    (((2, 3, ((3, 1.0), (2, 1.0))),), r"layers \[3, 2\] must be distinct, increasing"),
    (((2, 2, ()),), r"at least one"),
    (((2, 2, ((2, 65.0),)),), r"boundary_saves\[0\]: layer 2 saves 65.0 bytes of it, more than its activation_bytes"),
    (((2, 2, ((2, -1.0),)),), r"LayerProfile.boundary_saves\[0\] bytes of layer 2 must be a finite number >= 0"),
    (((2, 2),), r"boundary_saves must be \(first, last, \(\(layer, bytes\), ...\)\) per tensor"),
    ((5,), r"boundary_saves must be \(first, last"),
])
def test_boundary_saves_are_validated(saves, message):
    with pytest.raises(ValueError, match=message):
        LayerProfile(**{**_fields(tanh_stack()), "boundary_saves": saves})


def _fields(p):
    return {name: getattr(p, name) for name in p.__dataclass_fields__}
