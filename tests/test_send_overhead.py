"""CostModel.send_overhead (LogP's o): a SEND takes its rank's time, the message travels after it; the simulator, the
CLI, the cost line of pictures and the fitted costs of a measured timeline all carry it."""
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pipesched as ps
from pipesched import CostModel, CostError
from pipesched.ir import COMPUTE_OPS, Op
from pipesched.viz.style import cost_in_unit

SENDS = (Op.SEND_F, Op.SEND_B)


def test_one_microbatch_on_two_ranks_by_hand():
    # rank 0: F [0, 1], SEND_F [1, 1.25] -> lands 1.75; rank 1: F [1.75, 2.75], B [2.75, 4.75],
    # SEND_B [4.75, 5] -> lands 5.5; rank 0: B [5.5, 7.5]
    timeline = ps.simulate(ps.compile_program("1f1b", 2, 1), CostModel(latency=0.5, send_overhead=0.25))
    sends = sorted((e.rank, e.instr.op, e.start, e.end) for e in timeline.events if e.instr.op in SENDS)
    assert sends == [(0, Op.SEND_F, 1.0, 1.25), (1, Op.SEND_B, 4.75, 5.0)]
    assert timeline.makespan == 7.5
    assert timeline.busy_per_rank() == (3.0, 3.0)  # a SEND is not compute: its time is bubble
    assert timeline.bubble_fraction == pytest.approx(0.6)
    free = ps.simulate(ps.compile_program("1f1b", 2, 1), CostModel(latency=0.5))
    assert free.makespan == 7.0 and all(e.duration == 0 for e in free.events if e.instr.op in SENDS)


def test_a_compute_only_program_adds_the_overhead_to_each_message():
    cost = CostModel(latency=0.5, send_overhead=0.25)
    assert ps.simulate(ps.build("1f1b", 2, 1), cost).makespan == 7.5  # as its lowered form


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zbv", "dualpipev"]), p=st.integers(2, 5),
       m=st.integers(1, 10), overhead=st.sampled_from([0.0, 0.125, 0.5, 2.0]))
def test_every_send_takes_its_rank_the_overhead_and_nothing_gets_faster(schedule, p, m, overhead):
    if schedule == "dualpipev":
        m = max(m, 2)
    program = ps.compile_program(schedule, p, m)
    base = ps.simulate(program, CostModel(latency=0.25))
    timeline = ps.simulate(program, CostModel(latency=0.25, send_overhead=overhead))
    assert {e.duration for e in timeline.events if e.instr.op in SENDS} == {overhead}
    for rank in range(p):  # a rank does one thing at a time: its SENDs never overlap its computes
        taking = sorted((e.start, e.end) for e in timeline.events
                        if e.rank == rank and (e.instr.op in SENDS or e.instr.op in COMPUTE_OPS))
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(taking, taking[1:]))
    by_key = {(e.rank, e.instr): e.end for e in base.events}
    assert all(e.end >= by_key[e.rank, e.instr] - 1e-9 for e in timeline.events)  # costs only added
    assert timeline.busy_per_rank() == pytest.approx(base.busy_per_rank())


def test_bad_send_overheads_are_refused_and_numpy_held_plain():
    for bad in (-0.1, float("inf"), float("nan"), "0.1", [0.1, 0.2]):
        with pytest.raises(CostError, match="send_overhead") as err:
            CostModel(send_overhead=bad)
        assert err.value.field == "send_overhead"
    held = CostModel(send_overhead=np.float64(0.5))
    assert type(held.send_overhead) is float and held.send_overhead == 0.5


def test_overflowing_send_overheads_are_named():
    with pytest.raises(CostError, match="send_overhead") as err:
        ps.simulate(ps.compile_program("1f1b", 2, 4), CostModel(send_overhead=1e308))
    assert err.value.field == "send_overhead"


def test_describe_and_the_cost_line_in_ms():
    text = CostModel(forward=1e-3, backward=2e-3, latency=1e-4, send_overhead=2e-5).describe()
    assert text == "F=0.001 B=0.002 latency=0.0001s send=2e-05s"
    assert cost_in_unit(text, "ms", 1e3) == "F=1 B=2 latency=0.1ms send=0.02ms"
    assert "send" not in CostModel().describe()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipesched", *args], capture_output=True, text=True)


def test_cli_option():
    done = _cli("simulate", "1f1b", "-p", "2", "-m", "1", "--latency", "0.5", "--send-overhead", "0.25", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["makespan"] == 7.5
    bad = _cli("simulate", "1f1b", "-p", "2", "-m", "1", "--send-overhead", "-1")
    assert bad.returncode == 2
    assert "--send-overhead: cost send_overhead must be a finite number >= 0" in bad.stderr


def test_fitted_costs_of_a_timeline_read_the_overhead_back():
    from pipesched.viz.compare import fit_cost, predict_for

    cost = CostModel(forward=1e-3, backward=2e-3, latency=1e-4, send_overhead=5e-5)
    timeline = ps.simulate(ps.compile_program("1f1b", 4, 8), cost)
    measured = ps.Timeline(timeline.events, timeline.num_ranks, source="measured",
                           meta={k: v for k, v in timeline.meta.items() if k != "cost"})
    fitted = fit_cost(measured)
    assert fitted.send_overhead == pytest.approx(5e-5) and fitted.latency == pytest.approx(1e-4)
    assert predict_for(measured).makespan == pytest.approx(timeline.makespan)


def test_none_is_refused_where_a_field_has_no_default_and_0d_arrays_are_numbers():
    for name in ("send_overhead", "latency", "forward", "backward", "activation_bytes", "grad_bytes", "tie_bytes"):
        with pytest.raises(CostError, match=f"cost {name} must be a finite number >= 0 .* got None") as err:
            CostModel(**{name: None})
        assert err.value.field == name
    assert CostModel(input_grad=None, weight_grad=None, recompute=None).per_stage("input_grad", 2) == (1.0, 1.0)
    held = CostModel(forward=np.array(0.5), send_overhead=np.array(0.25), bandwidth=np.array(1e9))
    assert (held.forward, held.send_overhead, held.bandwidth) == (0.5, 0.25, 1e9)
    assert type(held.forward) is float


def test_a_profile_carries_the_send_overhead_into_its_costs_and_files(tmp_path):
    from pipesched.profile import LayerProfile

    profile = LayerProfile(forward=(1.0, 2.0), input_grad=(1.0, 1.0), weight_grad=(1.0, 1.0),
                           activation_bytes=(8, 8), output_bytes=(4, 4), param_bytes=(16, 16), microbatch_size=2,
                           latency=0.5, send_overhead=np.float64(0.25))
    assert type(profile.send_overhead) is float
    assert profile.costs([1, 1]).send_overhead == 0.25
    profile.save(tmp_path / "p.json")
    assert LayerProfile.load(tmp_path / "p.json") == profile
    old = {k: v for k, v in profile.to_json().items() if k != "send_overhead"}  # saved before the field
    assert LayerProfile.from_json(old).send_overhead == 0.0
    with pytest.raises(ValueError, match="send_overhead"):
        LayerProfile(forward=(1.0,), input_grad=(1.0,), weight_grad=(1.0,), activation_bytes=(8,), output_bytes=(4,),
                     param_bytes=(16,), microbatch_size=1, send_overhead=-1.0)
