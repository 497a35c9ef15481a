"""Integer-like arguments (numpy integers, any ``numbers.Integral`` that is not a bool) are accepted wherever an
integer is, and become plain ints at once: none reaches a Program, a Timeline, a Plan or their JSON. A bool is still
refused, naming the argument. Torch-free."""
import dataclasses
import json
import numbers

import pytest

import pipesched as ps
from pipesched import lower
from pipesched.cost import CostError, CostModel
from pipesched.errors import ScheduleArgumentError
from pipesched.planner import plan, predict
from pipesched.profile import LayerProfile

np = pytest.importorskip("numpy")

MiB = 2**20
I = np.int64


def numpy_values(obj, path="value"):
    """Paths of every numpy value inside ``obj`` (tuples, lists, dicts, dataclasses, named tuples, walked)."""
    if type(obj).__module__ == "numpy":
        return [f"{path}: {type(obj).__name__}"]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [p for f in dataclasses.fields(obj) if f.name != "timeline"
                for p in numpy_values(getattr(obj, f.name), f"{path}.{f.name}")]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in numpy_values(k, f"{path} key") + numpy_values(v, f"{path}[{k!r}]")]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in numpy_values(v, f"{path}[{i}]")]
    return []


def assert_plain_program(program):
    assert type(program.num_microbatches) is int and type(program.dp_size) is int
    assert numpy_values(program.stage_to_rank) == [] and numpy_values(program.meta) == []
    assert numpy_values([tuple(i) for stream in program.ranks for i in stream]) == []
    json.loads(ps.to_json(program))
    json.dumps(program.meta)


# ---- compile_program / build / the passes ----------------------------------------------------------------------

@pytest.mark.parametrize("schedule, p, m, v, extra", [
    ("1f1b", 2, 3, None, {}),
    ("gpipe", 3, 2, 1, {}),
    ("interleaved-1f1b", 2, 4, 2, {}),
    ("zbv", 2, 3, 2, {}),
    ("zb-h1", 2, 3, None, {"early_receives": 2}),
    ("1f1b", 2, 4, None, {"dp_size": 2, "early_receives": 3}),
    ("zb-auto", 2, 4, None, {"memory_limit": 2}),
    ("zb-auto", 2, 4, None, {"memory_limit": [2, 3]}),
])
def test_compile_program_takes_numpy_integers_and_gives_the_int_program(schedule, p, m, v, extra):
    want = ps.compile_program(schedule, p, m, v, **extra)
    np_extra = {k: ([I(x) for x in val] if isinstance(val, list) else I(val)) for k, val in extra.items()}
    got = ps.compile_program(schedule, I(p), I(m), None if v is None else I(v), **np_extra)
    assert got == want
    assert ps.to_json(got) == ps.to_json(want)
    assert_plain_program(got)
    assert ps.build(schedule, I(p), I(m), None if v is None else I(v)) == ps.build(schedule, p, m, v)


def test_other_integrals_are_accepted_too():
    class Count(numbers.Integral):  # a minimal foreign Integral: int() and comparison are all it needs here
        def __init__(self, n): self.n = n
        def __int__(self): return self.n
        def __index__(self): return self.n
        def __lt__(self, other): return self.n < other
        def __le__(self, other): return self.n <= other
        def __eq__(self, other): return self.n == other
        def __hash__(self): return hash(self.n)
        def __repr__(self): return f"Count({self.n})"
        __abs__ = __add__ = __and__ = __ceil__ = __floor__ = __floordiv__ = __invert__ = __lshift__ = __mod__ = \
            __mul__ = __neg__ = __or__ = __pos__ = __pow__ = __radd__ = __rand__ = __rfloordiv__ = __rlshift__ = \
            __rmod__ = __rmul__ = __ror__ = __round__ = __rpow__ = __rrshift__ = __rshift__ = __rtruediv__ = \
            __rxor__ = __truediv__ = __trunc__ = __xor__ = None

    got = ps.compile_program("1f1b", Count(2), Count(3), dp_size=Count(2))
    assert got == ps.compile_program("1f1b", 2, 3, dp_size=2)
    assert_plain_program(got)


def test_a_registered_schedule_gets_plain_ints():
    seen = []

    def builder(p, m, v):
        seen.append((type(p), type(m), type(v)))
        return ps.build("1f1b", p, m, v)

    ps.register_schedule("np-probe", builder, "probe")
    try:
        assert_plain_program(ps.compile_program("np-probe", I(2), I(3), I(1)))
    finally:
        ps.unregister_schedule("np-probe")
    assert seen == [(int, int, int)]


def test_the_passes_take_numpy_integers():
    program = ps.add_send_recv(ps.build("1f1b", 2, 4))
    assert lower.add_all_reduce(program, I(2)) == lower.add_all_reduce(program, 2)
    assert type(lower.add_all_reduce(program, I(2)).dp_size) is int
    assert lower.post_receives_early(program, I(3)) == lower.post_receives_early(program, 3)
    with pytest.raises(ValueError, match="dp_size must be an integer >= 1, got True"):
        lower.add_all_reduce(program, True)
    with pytest.raises(ValueError, match="window must be an integer >= 0 .* got False"):
        lower.post_receives_early(program, False)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(num_ranks=True, num_microbatches=2), "num_ranks"),
    (dict(num_ranks=2, num_microbatches=True), "num_microbatches"),
    (dict(num_ranks=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=True), "virtual_stages"),
    (dict(num_ranks=2, num_microbatches=2, dp_size=True), "dp_size"),
    (dict(num_ranks=2, num_microbatches=2, early_receives=False), "early_receives"),
    (dict(num_ranks=2, num_microbatches=2, schedule="zb-auto", memory_limit=True), "memory_limit"),
])
def test_a_bool_is_still_refused_naming_the_argument(kwargs, argument):
    kwargs = {"schedule": "1f1b", **kwargs}
    with pytest.raises(ScheduleArgumentError) as info:
        ps.compile_program(**kwargs)
    value = kwargs[argument]
    assert f"{argument} must be an integer >= " in str(info.value)
    assert f"got {value!r} (a bool is not a count)" in str(info.value)
    assert info.value.argument == argument


def test_virtual_stages_true_is_refused_by_a_one_stage_schedule():
    # True == 1, so a fixed-layout schedule's "virtual_stages must be 1" let it through
    with pytest.raises(ScheduleArgumentError, match=r"virtual_stages=True: 1f1b places one stage per rank") as info:
        ps.compile_program("1f1b", 2, 2, True)
    assert info.value.argument == "virtual_stages"


# ---- CostModel and simulate -------------------------------------------------------------------------------------

def test_cost_model_holds_numpy_numbers_as_plain_ones():
    cost = CostModel(forward=np.array([1, 2]), backward=[np.float64(2.0), I(3)], activation_bytes=I(4),
                     grad_bytes=np.array([8, 8], dtype=np.int32), latency=I(0), bandwidth=I(1000))
    assert cost.forward == (1, 2) and [type(x) for x in cost.forward] == [int, int]
    assert cost.backward == (2.0, 3) and [type(x) for x in cost.backward] == [float, int]
    assert (cost.activation_bytes, type(cost.activation_bytes)) == (4, int)
    assert (cost.latency, type(cost.latency), cost.bandwidth, type(cost.bandwidth)) == (0, int, 1000, int)
    assert numpy_values(cost) == []
    assert cost.describe() == "F=[1,2] B=[2,3] act=4B grads=[8,8]B bw=1e+03B/s"
    assert CostModel(forward=[1, 2]).forward == (1, 2)  # plain values as given, a list as a tuple (a copy)
    with pytest.raises(CostError, match=r"cost activation_bytes must be a number or a sequence of numbers \(one per "
                                        r"stage, in stage order: a list, tuple or 1-d array\), got True") as info:
        CostModel(activation_bytes=True)
    assert info.value.field == "activation_bytes"


def test_simulate_of_numpy_sizes_and_costs_equals_the_plain_one():
    want = ps.simulate(ps.compile_program("1f1b", 2, 4, dp_size=2),
                       CostModel(forward=[1, 2], activation_bytes=4, grad_bytes=8, bandwidth=100))
    got = ps.simulate(ps.compile_program("1f1b", I(2), I(4), dp_size=I(2)),
                      CostModel(forward=np.array([1, 2]), activation_bytes=I(4), grad_bytes=I(8), bandwidth=I(100)))
    assert got.makespan == want.makespan and got.meta == want.meta
    assert got.to_json_dict() == want.to_json_dict()
    json.dumps(got.to_json_dict())
    assert numpy_values(got.meta) == [] and numpy_values(list(got.peak_activation_bytes)) == []


# ---- the planner -------------------------------------------------------------------------------------------------

def profile6() -> LayerProfile:
    L = 6
    return LayerProfile(forward=[1e-3] * L, input_grad=[1e-3] * L, weight_grad=[1e-3] * L,
                        activation_bytes=[8 * MiB] * L, output_bytes=[MiB] * L, param_bytes=[4 * MiB] * L,
                        microbatch_size=1, latency=1e-5, bandwidth=1e9)


def test_plan_takes_numpy_integers_and_gives_the_int_plan():
    p = profile6()
    want = plan(p, 4, 2e9, 16, top=2, max_microbatches=8, virtual_stages=2, num_layers=6)
    got = plan(p, I(4), I(2_000_000_000), I(16), top=I(2), max_microbatches=I(8), virtual_stages=I(2),
               num_layers=I(6), optimizer_states=I(2))
    assert got.to_json() == want.to_json()
    json.dumps(got.to_json())
    assert numpy_values(list(got.candidates)) == []
    assert numpy_values([got.world_size, got.memory_per_rank, got.global_batch]) == []
    seq = plan(p, 4, 2e9, 16, top=2, max_microbatches=8, virtual_stages=np.array([2, 4]))
    assert seq.to_json() == plan(p, 4, 2e9, 16, top=2, max_microbatches=8, virtual_stages=(2, 4)).to_json()


def test_predict_takes_numpy_integers_and_gives_the_int_candidate():
    p = profile6()
    want = predict(p, 16, "interleaved-1f1b", 2, dp=2, num_microbatches=4, virtual_stages=2, balance=[2, 1, 1, 2])
    got = predict(p, I(16), "interleaved-1f1b", I(2), dp=I(2), num_microbatches=I(4), virtual_stages=I(2),
                  balance=np.array([2, 1, 1, 2]))
    assert got == want and got.to_json() == want.to_json()
    json.dumps(got.to_json())
    assert numpy_values(got) == []


@pytest.mark.parametrize("call, argument", [
    (lambda p: plan(p, True, 2e9, 16), "world_size"),
    (lambda p: plan(p, 4, 2e9, True), "global_batch"),
    (lambda p: plan(p, 4, 2e9, 16, top=True), "top"),
    (lambda p: plan(p, 4, 2e9, 16, max_microbatches=True), "max_microbatches"),
    (lambda p: predict(p, 16, "1f1b", True), "pp"),
    (lambda p: predict(p, 16, "1f1b", 2, dp=True), "dp"),
    (lambda p: predict(p, 16, "1f1b", 2, num_microbatches=True), "num_microbatches"),
])
def test_the_planner_still_refuses_a_bool(call, argument):
    with pytest.raises(ScheduleArgumentError, match=f"{argument} must be an integer >= 1, got True "
                                                    r"\(a bool is not a count\)") as info:
        call(profile6())
    assert info.value.argument == argument
    with pytest.raises(ScheduleArgumentError, match="virtual_stages must be an integer >= 1 or a non-empty sequence"):
        plan(profile6(), 4, 2e9, 16, virtual_stages=True)
