"""Per-layer costs and bytes given as numpy numbers (``np.int64``, ``np.float32``: any ``numbers.Real`` but a bool)
are accepted wherever a plain number is and are held as plain ints and floats at once: ``balance_by_time``'s
costs, memory and memory limit (a 1-d array of them too), every number of a ``LayerProfile`` and the planner's
``memory_per_rank`` and ``optimizer_states``. Bad values are refused with the existing messages. Torch-free."""
import json
import math

import pytest

from pipesched import plan
from pipesched.errors import ScheduleArgumentError
from pipesched.partition import balance_by_time
from pipesched.profile import LayerProfile

np = pytest.importorskip("numpy")


def plain(values):
    return all(type(v) in (int, float) for v in values)


# ---- balance_by_time --------------------------------------------------------------------------------------------

COSTS = [1, 2.5, 3, 4, 1, 1]  # 2.5, 0.25 ...: binary fractions, the same in float32


@pytest.mark.parametrize("costs", [
    [np.int64(1), np.float32(2.5), np.int32(3), np.float64(4), np.float16(1), np.uint8(1)],
    np.array(COSTS, dtype=np.float32),
    np.array(COSTS),
])
def test_balance_by_time_takes_numpy_costs(costs):
    assert balance_by_time(COSTS, 2) == (3, 3)
    got = balance_by_time(costs, 2)
    assert got == (3, 3) and all(type(b) is int for b in got)
    looped = balance_by_time(costs, 4, stage_to_rank=(0, 1, 0, 1), max_nodes=1000)
    assert looped == balance_by_time(COSTS, 4, stage_to_rank=(0, 1, 0, 1), max_nodes=1000)


def test_balance_by_time_takes_numpy_memory_and_limit():
    costs, memory = [1, 1, 1, 1], [4, 1, 1, 1]
    assert balance_by_time(costs, 2, memory=memory, memory_limit=5) == (2, 2)
    assert balance_by_time(costs, 2, memory=memory, memory_limit=4.5) == (1, 3)  # rank 0 would hold 5 > 4.5
    f32 = [np.float32(m) for m in memory]
    assert balance_by_time(costs, 2, memory=f32, memory_limit=np.float32(4.5)) == (1, 3)
    assert balance_by_time(np.array(costs, dtype=np.int64), 2, memory=np.array(memory, dtype=np.float32),
                           memory_limit=np.int64(5)) == (2, 2)
    with pytest.raises(ValueError, match=r"memory_limit=3\.5: no cut of the 4 layers into 2 stages keeps every rank "
                                         r"within it; the smallest largest per-rank memory of any cut is 4\.0$"):
        balance_by_time(costs, 2, memory=f32, memory_limit=np.float32(3.5))  # plain numbers in the message


@pytest.mark.parametrize("kwargs, message", [
    (dict(layer_costs=[1, np.bool_(True)]), r"layer_costs\[1\] must be a finite number >= 0, got "),
    (dict(layer_costs=[1, True]), r"layer_costs\[1\] must be a finite number >= 0, got True"),
    (dict(layer_costs=[1, np.float32("nan")]), r"layer_costs\[1\] must be a finite number >= 0, got .*nan"),
    (dict(layer_costs=[1, np.float64("inf")]), r"layer_costs\[1\] must be a finite number >= 0, got .*inf"),
    (dict(layer_costs=[np.int64(-1), 1]), r"layer_costs\[0\] must be a finite number >= 0, got .*-1"),
    (dict(layer_costs=[1, "2"]), r"layer_costs\[1\] must be a finite number >= 0, got '2'"),
    (dict(layer_costs=[1, 1j]), r"layer_costs\[1\] must be a finite number >= 0, got 1j"),
    (dict(layer_costs=np.array([[1, 2]])), r"layer_costs must be a sequence of numbers >= 0"),
    (dict(layer_costs=np.float32(1)), r"layer_costs must be a sequence of numbers >= 0"),
    (dict(layer_costs=[1, 1], memory=[np.float32(-2), 1]), r"memory\[0\] must be a finite number >= 0"),
    (dict(layer_costs=[1, 1], memory=[1, 1], memory_limit=np.float32(-1)),
     r"memory_limit must be a finite number of bytes >= 0, got "),
    (dict(layer_costs=[1, 1], memory=[1, 1], memory_limit=np.bool_(True)),
     r"memory_limit must be a finite number of bytes >= 0, got "),
])
def test_balance_by_time_still_refuses_what_is_no_cost(kwargs, message):
    with pytest.raises(ValueError, match=message):
        balance_by_time(num_stages=1, **kwargs)


# ---- LayerProfile -----------------------------------------------------------------------------------------------

def fields(kind=None):
    """A 3-layer profile's fields; ``kind``: a numpy type for every number (None: plain numbers)."""
    k = (lambda v: v) if kind is None else kind
    return dict(forward=[k(1.0), k(2.0), k(3.0)], input_grad=[k(0.5), k(1.0), k(1.5)],
                weight_grad=[k(0.0), k(1.0), k(2.0)], activation_bytes=[k(10), k(20), k(30)],
                output_bytes=[k(4), k(8), k(2)], param_bytes=[k(0), k(100), k(200)], microbatch_size=2,
                input_bytes=k(6), latency=k(0.25), bandwidth=k(1000), forward_fixed=[k(0.5), k(0.5), k(0.5)],
                input_grad_fixed=[k(0), k(0.25), k(0.25)], weight_grad_fixed=[k(0), k(0.5), k(0.5)],
                boundary_saves=[(1, 1, [(0, k(4)), (1, k(4))])])


def numbers_of(p: LayerProfile):
    """Every number a profile holds (the per-layer fields, the scalars, the bytes of ``boundary_saves``)."""
    per_layer = [v for name in ("forward", "input_grad", "weight_grad", "activation_bytes", "output_bytes",
                                "param_bytes", "forward_fixed", "input_grad_fixed", "weight_grad_fixed")
                 for v in getattr(p, name)]
    saves = [b for _, _, entries in p.boundary_saves for _, b in entries]
    return per_layer + [p.input_bytes, p.latency, p.bandwidth] + saves


@pytest.mark.parametrize("kind", [np.float32, np.float64, np.float16])
def test_layer_profile_holds_numpy_numbers_as_plain_ones(kind):
    want = LayerProfile(**fields())
    got = LayerProfile(**fields(kind))
    assert plain(numbers_of(got)), [type(v) for v in numbers_of(got)]
    assert got == want
    text = json.dumps(got.to_json())  # numpy's float32 is no JSON number: a TypeError if one were held
    assert json.loads(text) == json.loads(json.dumps(want.to_json()))
    assert LayerProfile.from_json(json.loads(text)) == want
    assert got.costs([1, 2]) == want.costs([1, 2]) and got.scaled(4) == want.scaled(4)
    assert balance_by_time(got.layer_seconds(), 2, memory=got.activation_bytes) == (2, 1)


def test_layer_profile_holds_numpy_integers_as_ints():
    f = dict(forward=np.array([1, 2], dtype=np.int64), input_grad=[np.int32(1), np.uint16(2)],
             weight_grad=np.zeros(2, dtype=np.int8), activation_bytes=np.array([10, 20], dtype=np.int64),
             output_bytes=[np.int64(4), 8], param_bytes=[0, np.int64(100)], microbatch_size=np.int64(1),
             input_bytes=np.int64(6), latency=np.int64(0), bandwidth=np.int64(1000))
    p = LayerProfile(**f)
    held = [v for name in ("forward", "input_grad", "weight_grad", "activation_bytes", "output_bytes", "param_bytes")
            for v in getattr(p, name)] + [p.input_bytes, p.latency, p.bandwidth]
    assert all(type(v) is int for v in held), [type(v) for v in held]
    assert p.activation_bytes == (10, 20) and p.bandwidth == 1000 and type(p.bandwidth) is int
    assert LayerProfile.from_json(json.loads(json.dumps(p.to_json()))) == p


@pytest.mark.parametrize("changes, message", [
    (dict(forward=[np.bool_(True), 2.0, 3.0]), r"LayerProfile.forward\[0\] must be a finite number >= 0"),
    (dict(forward=[True, 2.0, 3.0]), r"LayerProfile.forward\[0\] must be a finite number >= 0 .*got True"),
    (dict(output_bytes=[4, np.float32("nan"), 2]), r"LayerProfile.output_bytes\[1\] must be a finite number >= 0"),
    (dict(param_bytes=[0, np.int64(-100), 200]), r"LayerProfile.param_bytes\[1\] must be a finite number >= 0"),
    (dict(input_bytes=np.float32("inf")), r"LayerProfile.input_bytes must be a finite number >= 0"),
    (dict(latency=np.float32(-0.5)), r"LayerProfile.latency must be a finite number >= 0"),
    (dict(latency=True), r"LayerProfile.latency must be a finite number >= 0 .*got True"),
    (dict(bandwidth=np.float32(0)), r"LayerProfile.bandwidth must be bytes/s > 0"),
    (dict(bandwidth=True), r"LayerProfile.bandwidth must be bytes/s > 0 \(inf: free\), got True"),
    (dict(bandwidth="1000"), r"LayerProfile.bandwidth must be bytes/s > 0"),
    (dict(forward_fixed=[np.float32(0.5), np.float32(-0.5), 0]), r"LayerProfile.forward_fixed\[1\] must be a finite"),
    (dict(forward_fixed=[np.float32(1.5), 0, 0]), r"LayerProfile.forward_fixed\[0\] = .*1\.5.* s exceeds forward\[0\]"),
    (dict(boundary_saves=[(1, 1, [(0, np.float32(-4))])]),
     r"LayerProfile.boundary_saves\[0\] bytes of layer 0 must be a finite number >= 0"),
    (dict(boundary_saves=[(1, 1, [(0, np.float32(11))])]),
     r"LayerProfile.boundary_saves\[0\]: layer 0 saves .*11.* bytes of it, more than its activation_bytes 10"),
])
def test_layer_profile_still_refuses_bad_numbers(changes, message):
    with pytest.raises(ValueError, match=message):
        LayerProfile(**{**fields(), **changes})


# ---- the planner's bytes ----------------------------------------------------------------------------------------

def test_plan_takes_numpy_memory_and_optimizer_states():
    p = LayerProfile(**fields())
    want = plan(p, 2, 4096.0, 4, schedules=["1f1b"], top=1, optimizer_states=2.0)
    got = plan(p, 2, np.float32(4096), 4, schedules=["1f1b"], top=1, optimizer_states=np.float32(2))
    assert got.to_json() == want.to_json() and type(got.memory_per_rank) is float
    json.dumps(got.to_json())
    for value in (np.bool_(True), True, np.float32(math.inf), np.float32(0)):
        with pytest.raises(ScheduleArgumentError, match="memory_per_rank must be a number of bytes > 0"):
            plan(p, 2, value, 4, schedules=["1f1b"], top=1)
    with pytest.raises(ScheduleArgumentError, match="optimizer_states must be a number >= 0"):
        plan(p, 2, 4096.0, 4, schedules=["1f1b"], top=1, optimizer_states=np.float32(-1))
