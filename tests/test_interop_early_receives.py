"""to_torch_csv of a program whose receives are posted early: torch's receives block where they are posted, so
the file is written with each receive just before its use (warned), and torch's own dry run runs it."""
import types
import warnings

import pytest

import pipesched as ps
from pipesched.interop import TorchCsvWarning, from_torch_csv, to_torch_csv

S = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_dry_run(path, program):
    p, n = program.num_ranks, program.num_stages
    stages = [types.SimpleNamespace(num_stages=n, group_size=p, group_rank=0, submod=None, stage_index=i)
              for i in range(n // p)]
    runtime = S._PipelineScheduleRuntime(stages, program.num_microbatches)
    runtime._load_csv(str(path), format="compute_comms")
    order = {r: [a for a in acts if a.computation_type.value != "REDUCE_GRAD"]
             for r, acts in runtime.pipeline_order_with_comms.items()}
    S._simulate_comms_compute(order, program.stage_to_rank.__getitem__, n)


@pytest.mark.parametrize("name,p,m,early", [("1f1b", 2, 2, 4), ("1f1b", 4, 8, 16), ("gpipe", 3, 6, 4),
                                            ("interleaved-1f1b", 2, 4, 16), ("zb-h1", 4, 8, 4), ("zbv", 2, 4, 16)])
def test_early_receives_are_written_where_torch_runs_them(tmp_path, name, p, m, early):
    program = ps.compile_program(name, p, m, early_receives=early)
    path = tmp_path / "early.csv"
    with pytest.warns(TorchCsvWarning, match="early_receives"):
        to_torch_csv(program, path)
    torch_dry_run(path, program)  # raised IndexError / "Schedule is not progressing" before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)  # the REDUCE_GRAD dropped at dp_size=1
        back = from_torch_csv(path, dp_size=1)
    assert back.ranks == ps.compile_program(name, p, m).ranks  # the receives back in program order


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv"])
def test_program_order_is_written_unchanged_without_warning(tmp_path, name):
    program = ps.compile_program(name, 2, 4)
    path = tmp_path / "plain.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchCsvWarning)
        to_torch_csv(program, path)
    torch_dry_run(path, program)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)  # the REDUCE_GRAD dropped at dp_size=1
        assert from_torch_csv(path, dp_size=1).ranks == program.ranks


def test_dp_program_with_early_receives(tmp_path):
    program = ps.compile_program("1f1b", 2, 4, dp_size=2, early_receives=4)
    with pytest.warns(TorchCsvWarning, match="program order"):
        to_torch_csv(program, tmp_path / "dp.csv")
    assert from_torch_csv(tmp_path / "dp.csv", dp_size=2).ranks == ps.compile_program("1f1b", 2, 4, dp_size=2).ranks
