"""Bad arguments of the torch-free API that used to pass: flags taken by truthiness (``forward_only="no"`` compiled
the forward-only program, ``simulate(check=0)`` skipped validation, ``to_torch_csv(comms="no")`` wrote the
compute_comms form), ``from_torch_csv(schedule=None)`` made a program whose label is no string, a non-sequence
``stage_to_rank`` failed inside ``tuple()``, and ``rank_loads`` indexed past a ``balance`` that did not fit. Each is
now refused before any work, with the argument, its value and what is valid in the message."""
from __future__ import annotations

import math
import os

import pytest

import pipesched
from pipesched import ScheduleArgumentError, compile_program, rank_loads, simulate
from pipesched.interop import from_torch_csv, to_torch_csv

P = compile_program("1f1b", 2, 4)


@pytest.mark.parametrize("value, shown", [("no", "str 'no'"), (1, "int 1"), (math.nan, "float nan"), (None, "NoneType None")])
def test_compile_program_refuses_a_forward_only_that_is_no_bool(value, shown):
    with pytest.raises(ScheduleArgumentError) as info:
        compile_program("1f1b", 2, 4, forward_only=value)
    assert str(info.value) == f"forward_only must be True or False, got {shown}"
    assert info.value.argument == "forward_only"


def test_compile_program_forward_only_bools_still_work():
    assert compile_program("1f1b", 2, 4, forward_only=True).forward_only is True
    assert compile_program("1f1b", 2, 4, forward_only=False).forward_only is False


@pytest.mark.parametrize("value, shown", [("no", "str 'no'"), (0, "int 0"), (None, "NoneType None")])
def test_simulate_refuses_a_check_that_is_no_bool(value, shown):
    with pytest.raises(TypeError) as info:
        simulate(P, check=value)
    assert str(info.value) == f"simulate: check must be True or False, got {shown}"


def test_simulate_check_bools_give_the_same_makespan():
    assert simulate(P, check=False).makespan == simulate(P, check=True).makespan == 15.0


@pytest.mark.parametrize("value, shown", [("no", "str 'no'"), (1, "int 1"), (math.nan, "float nan")])
def test_to_torch_csv_refuses_comms_that_is_no_bool_and_writes_nothing(tmp_path, value, shown):
    path = tmp_path / "s.csv"
    with pytest.raises(TypeError) as info:
        to_torch_csv(P, path, comms=value)
    assert str(info.value) == (f"to_torch_csv: comms must be True, False or None (the program's own form), got "
                               f"{shown}")
    assert not os.path.exists(path)


def test_to_torch_csv_comms_none_true_false_still_work(tmp_path):
    for k, comms in enumerate((None, True, False)):
        to_torch_csv(P, tmp_path / f"{k}.csv", comms=comms)
    assert (tmp_path / "0.csv").read_text() == (tmp_path / "1.csv").read_text()
    assert "SEND_F" not in (tmp_path / "2.csv").read_text()


@pytest.mark.filterwarnings("ignore::pipesched.interop.TorchCsvWarning")  # the REDUCE_GRADs dropped at dp_size=1
@pytest.mark.parametrize("value, shown", [(None, "NoneType None"), (True, "bool True"), (2.0, "float 2.0")])
def test_from_torch_csv_refuses_a_schedule_label_that_is_no_str(tmp_path, value, shown):
    path = tmp_path / "s.csv"
    to_torch_csv(P, path)
    with pytest.raises(TypeError) as info:
        from_torch_csv(path, schedule=value)
    assert str(info.value) == f"from_torch_csv: schedule must be a str (the program's label), got {shown}"
    assert from_torch_csv(path, schedule="mine").schedule == "mine"


@pytest.mark.parametrize("value, shown", [(2, "int 2"), (math.nan, "float nan"), ("01", "str '01'")])
def test_from_torch_csv_refuses_a_stage_to_rank_that_is_no_sequence(tmp_path, value, shown):
    path = tmp_path / "s.csv"
    to_torch_csv(P, path)
    with pytest.raises(TypeError) as info:
        from_torch_csv(path, stage_to_rank=value)
    assert str(info.value) == (f"from_torch_csv: stage_to_rank must be None or a sequence of integer ranks (one per "
                               f"stage), got {shown}")


@pytest.mark.parametrize("balance", ["2", 2, None, [1, 1], [0, 3], [True, 2], [1.0, 2], []])
def test_rank_loads_refuses_a_balance_that_does_not_cut_the_values(balance):
    with pytest.raises(ValueError) as info:
        rank_loads([1, 2, 3], balance)
    assert str(info.value) == (f"balance must be a sequence of layer counts (integers >= 1) summing to "
                               f"len(values)=3, got {balance!r}")


@pytest.mark.parametrize("s2r", [[0], [0, 1, 2], [0, -1], [0, "1"], 1])
def test_rank_loads_refuses_a_stage_to_rank_that_does_not_fit_the_stages(s2r):
    with pytest.raises(ValueError) as info:
        rank_loads([1, 2, 3], [1, 2], s2r)
    assert str(info.value) == f"stage_to_rank must be None or one integer rank >= 0 per stage (2 stages), got {s2r!r}"


def test_rank_loads_still_sums_per_rank():
    assert rank_loads([1, 2, 3], [1, 2]) == (1, 5)
    assert rank_loads([1, 2, 3, 4], (1, 1, 1, 1), (0, 1, 1, 0)) == (5, 5)
    assert pipesched.rank_loads is rank_loads


def _profile(layers: int = 4) -> pipesched.LayerProfile:
    return pipesched.LayerProfile(forward=[1e-3] * layers, input_grad=[1e-3] * layers, weight_grad=[1e-3] * layers,
                                  activation_bytes=[2**20] * layers, output_bytes=[2**20] * layers,
                                  param_bytes=[2**20] * layers, microbatch_size=1, input_bytes=2**20, latency=1e-5,
                                  bandwidth=1e9, layer_names=["Block"] * layers)


@pytest.mark.parametrize("value, shown", [("no", "str 'no'"), (0, "int 0"), (math.nan, "float nan")])
def test_plan_refuses_a_split_backward_that_is_no_bool(value, shown):
    with pytest.raises(ScheduleArgumentError) as info:
        pipesched.plan(_profile(), 2, 2**40, 8, split_backward=value)
    assert str(info.value) == f"split_backward must be None (try both), True or False, got {shown}"
    assert info.value.argument == "split_backward"


def test_plan_split_backward_false_plans_no_split():
    assert not any(c.split_backward for c in pipesched.plan(_profile(), 2, 2**40, 8, split_backward=False))
