"""Odd rows and stray cells in torch schedule CSVs (pipesched/interop.py), and the public names and argument checks
of pipesched.interop and pipesched.testing.

A line without actions (a blank line) is a rank without work: torch's ``_dump_csv`` (and our ``to_torch_csv``)
writes such a rank so and torch's ``_load_csv`` reads it so, wherever it is; its group size then refuses a stray one.
``from_torch_csv`` reads it the same way, and, where no ``num_ranks`` stands for that group size, warns naming the
line; blank lines after the last row with actions and past a given ``num_ranks`` are ignored."""
import csv
import io
import re
import types
import warnings

import numpy as np
import pytest

import pipesched as ps
from pipesched.cli import main
from pipesched.interop import TorchCsvWarning, from_torch_csv, to_torch_csv, torch_rows
from pipesched.ir import Instr, Op, Program

#: interleaved 1F1B, p=2, m=4, compute_only: stages 0, 2 on rank 0, stages 1, 3 on rank 1 (as torch writes it)
ROW0 = "0F0,0F1,2F0,2F1,,,0F2,2B0,0F3,2B1,2F2,0B0,2F3,0B1,,2B2,,2B3,,0B2,,0B3"
ROW1 = ",1F0,1F1,,3F0,3B0,3F1,3B1,1F2,1B0,1F3,1B1,3F2,3B2,3F3,3B3,,1B2,,1B3"
IDLE_SAYS = ("a rank without work, as torch's _load_csv reads a blank line (its _dump_csv writes a rank without "
             "actions so)")


def write(tmp_path, text, name="s.csv"):
    path = tmp_path / name
    path.write_text(text, newline="")
    return path


def read_warning_free(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return from_torch_csv(path, **kwargs)


# --- blank lines ---------------------------------------------------------------------------------------------------

def test_a_trailing_blank_line_is_an_idle_rank_as_torch_reads_it_and_the_warning_names_it(tmp_path):
    path = write(tmp_path, f"{ROW0}\n{ROW1}\n\n")
    with pytest.warns(TorchCsvWarning) as caught:
        program = from_torch_csv(path)
    assert [str(w.message) for w in caught] == [
        f"{path}: line 3 has no actions: read as rank 2, {IDLE_SAYS}; if it is a stray line, delete it (each row is "
        f"a rank, in order), or pass num_ranks=2 to ignore it"]
    assert caught[0].filename == __file__  # it points at the caller
    assert program.num_ranks == 3 and program.stage_to_rank == (0, 1, 0, 1) and program.ranks[2] == ()
    # num_ranks stands for torch's group size: the blank line past it is ignored, without a warning
    two = read_warning_free(path, num_ranks=2)
    assert two.num_ranks == 2 and two.ranks == program.ranks[:2]
    assert read_warning_free(write(tmp_path, f"{ROW0}\n{ROW1}\n", "clean.csv")).ranks == two.ranks
    # num_ranks=3 says the blank line is a rank: no warning either
    assert read_warning_free(path, num_ranks=3).ranks == program.ranks


def test_a_blank_line_between_rows_is_an_idle_rank_and_the_warning_names_it(tmp_path):
    path = write(tmp_path, f"{ROW0}\r\n\r\n{ROW1}\r\n")
    with pytest.warns(TorchCsvWarning) as caught:
        program = from_torch_csv(path)
    assert [str(w.message) for w in caught] == [
        f"{path}: line 2 has no actions: read as rank 1, {IDLE_SAYS}; if it is a stray line, delete it (each row is "
        f"a rank, in order)"]
    assert program.num_ranks == 3 and program.stage_to_rank == (0, 2, 0, 2) and program.ranks[1] == ()
    ps.validate(ps.add_send_recv(program))  # a rank without work is a valid program: it is not refused
    with pytest.raises(ValueError) as info:  # torch's group of 2 refuses it too
        from_torch_csv(path, num_ranks=2)
    assert str(info.value) == (f"from_torch_csv: num_ranks=2, but {path} has 3 rows (one per rank; line 2 has no "
                               f"actions: torch reads it as a rank without work too; if it is a stray line, delete "
                               f"it)")
    assert read_warning_free(path, num_ranks=3).ranks == program.ranks


def test_several_lines_without_actions_are_named_in_one_warning(tmp_path):
    # a line of empty cells or spaces has no actions either (torch reads each cell as an idle slot)
    path = write(tmp_path, "0F0,0B0\n\n1F0,1B0\n,, \n\n")
    with pytest.warns(TorchCsvWarning) as caught:
        program = from_torch_csv(path)
    assert [str(w.message) for w in caught] == [
        f"{path}: lines 2, 4, 5 have no actions: read as ranks 1, 3, 4, ranks without work, as torch's _load_csv "
        f"reads a blank line (its _dump_csv writes a rank without actions so); if they are stray lines, delete them "
        f"(each row is a rank, in order), or pass num_ranks=3 to ignore those after the last row with actions"]
    assert program.num_ranks == 5 and program.stage_to_rank == (0, 2)
    only_trailing = write(tmp_path, "0F0,0B0\n1F0,1B0\n\n\n", "t.csv")
    with pytest.warns(TorchCsvWarning, match=r"lines 3, 4 have no actions: .*, or pass num_ranks=2 to ignore them$"):
        from_torch_csv(only_trailing)
    assert read_warning_free(only_trailing, num_ranks=2).num_ranks == 2
    assert read_warning_free(only_trailing, num_ranks=3).num_ranks == 3


def test_a_file_of_blank_lines_has_no_actions(tmp_path):
    for text in ("", "\n", "\r\n\r\n", " \n,\n"):
        with pytest.raises(ps.ProgramFormatError, match="no actions .a torch schedule CSV has one row of actions"):
            read_warning_free(write(tmp_path, text))
        with pytest.raises(ps.ProgramFormatError, match="no actions"):
            read_warning_free(write(tmp_path, text), num_ranks=1)


def test_our_idle_rank_round_trips_as_torch_writes_it(tmp_path):
    m = 2
    all_on_0 = Program([[Instr(Op.F, s, mb) for mb in range(m) for s in range(2)]
                        + [Instr(Op.B, s, mb) for mb in range(m) for s in (1, 0)], []], stage_to_rank=(0, 0),
                       num_microbatches=m)
    ps.validate(all_on_0)
    path = tmp_path / "idle.csv"
    to_torch_csv(all_on_0, path, comms=False)
    assert path.read_bytes() == b"0F0,1F0,0F1,1F1,1B0,0B0,1B1,0B1\r\n\r\n"  # the idle rank: a blank line
    buffer = io.StringIO()  # as torch's _dump_csv writes it (csv.writer.writerow of each rank's actions)
    csv.writer(buffer).writerows(torch_rows(all_on_0, comms=False))
    assert buffer.getvalue().encode() == path.read_bytes()
    with pytest.warns(TorchCsvWarning, match="line 2 has no actions: read as rank 1"):
        assert from_torch_csv(path).ranks == all_on_0.ranks
    assert read_warning_free(path, num_ranks=2).ranks == all_on_0.ranks


def test_torch_reads_a_blank_line_as_a_rank_without_actions(tmp_path):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    m = 2
    all_on_0 = Program([[Instr(Op.F, s, mb) for mb in range(m) for s in range(4)]
                        + [Instr(Op.B, s, mb) for mb in range(m) for s in (3, 2, 1, 0)], []],
                       stage_to_rank=(0,) * 4, num_microbatches=m)
    path = tmp_path / "idle.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        to_torch_csv(all_on_0, path, comms=True)
    stages = [types.SimpleNamespace(num_stages=4, group_size=2, group_rank=0, submod=None, stage_index=i)
              for i in range(2)]
    torch_schedule = schedules.ScheduleInterleaved1F1B(stages, m, loss_fn=None)
    torch_schedule._load_csv(str(path), format="compute_comms")
    order = torch_schedule.pipeline_order_with_comms
    assert sorted(order) == [0, 1] and order[1] == [] and len(order[0]) > 0
    with pytest.warns(TorchCsvWarning, match="line 2 has no actions: read as rank 1"):
        assert from_torch_csv(path, dp_size=2).ranks[1] == ()


def test_cli_validate_notes_the_blank_line_without_the_api_argument(tmp_path, capsys):
    path = write(tmp_path, f"{ROW0}\n{ROW1}\n\n")
    code = main(["validate", "--torch-csv", str(path)])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith(f"valid: {path}: 3 ranks, 4 stages")
    assert err == (f"note: {path}: line 3 has no actions: read as rank 2, {IDLE_SAYS}; if it is a stray line, "
                   f"delete it (each row is a rank, in order)\n")


# --- stray cells ---------------------------------------------------------------------------------------------------

def test_a_stray_stage_cell_is_named_by_line_and_column(tmp_path):
    path = write(tmp_path, f"{ROW0},9F0\n{ROW1}\n")
    with pytest.raises(ps.ProgramFormatError) as info:
        from_torch_csv(path)
    assert str(info.value) == (f"{path}, line 1, column 23 (rank 0, 9F0): stage 4 has no action, so its rank is "
                               f"unknown (stages 0..3, 9 appear; this is the only action of a stage above 4: a "
                               f"typo?); pass stage_to_rank to read the file as it is")
    path = write(tmp_path, f"{ROW0}\n{ROW1}\n5F0\n", "row.csv")  # a third row with a stage of its own
    with pytest.raises(ps.ProgramFormatError, match=re.escape(
            f"{path}, line 3, column 1 (rank 2, 5F0): stage 4 has no action, so its rank is unknown (stages 0..3, 5 "
            f"appear; this is the only action of a stage above 4: a typo?)")):
        from_torch_csv(path)


def test_a_gap_of_stages_names_the_first_action_past_it(tmp_path):
    path = write(tmp_path, "0F0,0B0\r\n,2F0,2B0\r\n,3F0,3B0\r\n")
    with pytest.raises(ps.ProgramFormatError) as info:
        from_torch_csv(path)
    assert str(info.value) == (f"{path}, line 2, column 2 (rank 1, 2F0): stage 1 has no action, so its rank is "
                               f"unknown (stages 0, 2, 3 appear; this is the first of the 4 actions of stages above 1)"
                               f"; pass stage_to_rank to read the file as it is")


def test_a_stray_microbatch_cell_is_named_by_line_and_column(tmp_path):
    path = write(tmp_path, f"{ROW0},0F7\n{ROW1}\n")
    with pytest.raises(ps.ProgramFormatError) as info:
        from_torch_csv(path)
    assert str(info.value) == (f"{path}, line 1, column 23 (rank 0, 0F7): microbatch 4 has no action (microbatches "
                               f"0..3, 7 appear, and m is the largest + 1; this is the only action of a microbatch "
                               f"above 4: a typo?); pass num_microbatches to read the file as it is")
    program = from_torch_csv(path, num_microbatches=8)  # read as it is: then the validator says what is missing
    assert program.num_microbatches == 8
    with pytest.raises(ps.ScheduleError):
        ps.validate(ps.add_send_recv(program))


def test_a_microbatch_in_an_overlap_group_or_a_message_counts(tmp_path):
    path = write(tmp_path, "0F0,0SEND_F0,0F2,0SEND_F2\r\n1RECV_F0,1F0,(1F2;1B0)OVERLAP_F_B\r\n")
    with pytest.raises(ps.ProgramFormatError) as info:
        from_torch_csv(path)
    assert str(info.value) == (f"{path}, line 1, column 3 (rank 0, 0F2): microbatch 1 has no action (microbatches "
                               f"0, 2 appear, and m is the largest + 1; this is the first of the 3 actions of "
                               f"microbatches above 1); pass num_microbatches to read the file as it is")


def test_a_file_without_microbatches_says_so(tmp_path):
    path = write(tmp_path, "0UNSHARD,0REDUCE_GRAD\r\n")
    with pytest.raises(ps.ProgramFormatError) as info:
        read_warning_free(path)
    assert str(info.value) == (f"{path}: no action names a microbatch (only REDUCE_GRAD, UNSHARD), so the number of "
                               f"microbatches is unknown; pass num_microbatches")


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 3, 5, 1), ("interleaved-1f1b", 2, 4, 2), ("zbv", 2, 3, 2),
                                           ("dualpipev", 2, 4, 2)])
def test_valid_files_are_still_read(tmp_path, name, p, m, v):
    program = ps.compile_program(name, p, m, v)
    to_torch_csv(program, tmp_path / "c.csv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)  # the REDUCE_GRAD dropped at dp_size=1
        back = from_torch_csv(tmp_path / "c.csv")
    assert back.ranks == program.ranks and back.stage_to_rank == program.stage_to_rank


# --- public names --------------------------------------------------------------------------------------------------

def test_star_imports_give_the_documented_names_only():
    import pipesched.interop
    import pipesched.testing

    assert pipesched.interop.__all__ == ["TorchCsvWarning", "from_torch_csv", "to_torch_csv"]
    assert pipesched.testing.__all__ == ["check_program", "cost_models", "schedule_configs"]
    for module in ("pipesched.interop", "pipesched.testing"):
        names = {}
        exec(f"from {module} import *", names)
        assert sorted(k for k in names if k != "__builtins__") == sorted(__import__(
            module, fromlist=["__all__"]).__all__)


def test_the_readmes_imports_still_work():
    from pipesched.interop import from_torch_csv as a, to_torch_csv as b  # noqa: F401
    from pipesched.interop import OVERLAP_META, TORCH_META, torch_rows  # noqa: F401  (named, not starred)
    from pipesched.testing import ScheduleConfig, check_program  # noqa: F401
    from pipesched.testing import cost_models as c, schedule_configs as d  # noqa: F401


# --- pipesched.testing's arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, says", [
    (lambda t: t.cost_models(0), ValueError, "cost_models: num_stages must be an integer >= 1, got 0"),
    (lambda t: t.cost_models(-2), ValueError, "cost_models: num_stages must be an integer >= 1, got -2"),
    (lambda t: t.cost_models(True), TypeError,
     "cost_models: num_stages must be an integer >= 1, got bool True (a bool is not a count)"),
    (lambda t: t.cost_models(2.0), TypeError, "cost_models: num_stages must be an integer >= 1, got float 2.0"),
    (lambda t: t.cost_models(2, uniform="yes"), TypeError, "cost_models: uniform must be True or False, got str 'yes'"),
    (lambda t: t.cost_models(2, with_comm=1), TypeError, "cost_models: with_comm must be True or False, got int 1"),
    (lambda t: t.schedule_configs(names="1f1b"), TypeError,
     "schedule_configs: names must be None (every built-in schedule) or a list of schedule names, got str '1f1b' "
     "(for one schedule: names=['1f1b'])"),
    (lambda t: t.schedule_configs(names=5), TypeError,
     "schedule_configs: names must be None (every built-in schedule) or a list of schedule names, got int 5"),
    (lambda t: t.schedule_configs(names=["1f1b", 2]), TypeError,
     "schedule_configs: names must hold schedule names (str), got int 2 in ('1f1b', 2)"),
    (lambda t: t.schedule_configs(names=[]), ValueError,
     "schedule_configs: names is empty: give at least one schedule name, or None for every built-in schedule"),
    (lambda t: t.schedule_configs(recompute="x"), TypeError,
     "schedule_configs: recompute must be True, False or None (drawn), got str 'x'"),
    (lambda t: t.schedule_configs(max_ranks=0), ValueError,
     "schedule_configs: max_ranks must be an integer >= 1, got 0"),
    (lambda t: t.schedule_configs(max_microbatches=-1), ValueError,
     "schedule_configs: max_microbatches must be an integer >= 1, got -1"),
    (lambda t: t.schedule_configs(max_virtual_stages=1.5), TypeError,
     "schedule_configs: max_virtual_stages must be an integer >= 1, got float 1.5"),
    (lambda t: t.schedule_configs(max_dp=False), TypeError,
     "schedule_configs: max_dp must be an integer >= 1, got bool False (a bool is not a count)"),
])
def test_testing_strategies_check_their_arguments_when_called(call, error, says):
    import pipesched.testing as t

    with pytest.raises(error) as info:
        call(t)  # when called: not only when hypothesis first draws from the strategy
    assert type(info.value) is error and str(info.value) == says


def test_testing_strategies_still_draw():
    from hypothesis import given, settings
    from pipesched.testing import ScheduleConfig, cost_models, schedule_configs

    strategy = schedule_configs(names=("1f1b", "gpipe"), max_ranks=np.int64(2), max_microbatches=3, max_dp=1,
                                recompute=False)
    assert repr(strategy).startswith("schedule_configs(names=('1f1b', 'gpipe'), max_ranks=2,")

    @settings(max_examples=10, database=None)
    @given(strategy, cost_models(np.int64(3)), cost_models(2, uniform=True))
    def check(config, cost, uniform):
        assert isinstance(config, ScheduleConfig) and config.schedule in ("1f1b", "gpipe")
        assert 1 <= config.num_ranks <= 2 and 1 <= config.num_microbatches <= 3 and config.dp_size == 1
        assert config.recompute is False
        assert len(cost.forward) == 3 and isinstance(uniform.forward, float)

    check()


def test_an_unknown_name_among_several_is_told_at_the_first_draw():
    from hypothesis import given, settings
    from pipesched.testing import schedule_configs

    strategy = schedule_configs(names=["1f1b", "no-such-schedule"])  # registering it later would still be fine

    @settings(max_examples=1, database=None)
    @given(strategy)
    def check(config):
        pass

    with pytest.raises(ps.UnknownScheduleError, match="unknown schedule 'no-such-schedule'; valid names: 1f1b"):
        check()
