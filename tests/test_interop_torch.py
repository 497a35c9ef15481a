"""pipesched's torch CSV interop against torch 2.13's own code: its schedule classes (built without a process group,
from stand-in stages), its CSV reader and writer (``_load_csv``/``_dump_csv``), and its own schedule checks
(``_validate_schedule``, the lowering ``_add_send_recv``, the dry run ``_simulate_comms_compute``)."""
import csv
import re
import types
import warnings
from pathlib import Path

import pytest

import pipesched as ps
from pipesched.interop import TorchCsvWarning, from_torch_csv, to_torch_csv, torch_rows
from pipesched.ir import Op

S = pytest.importorskip("torch.distributed.pipelining.schedules")
FSDP_ONLY = ("UNSHARD", "RESHARD")


def stand_in_stages(p: int, num_stages: int):
    """What a schedule class reads of its stages to compute ``pipeline_order`` for every rank: sizes, no modules."""
    return [types.SimpleNamespace(num_stages=num_stages, group_size=p, group_rank=0, submod=None, stage_index=i)
            for i in range(num_stages // p)]


def torch_schedule(cls, p: int, m: int, defer_pp_recv: bool = False):
    """torch's schedule ``cls`` with two stages per rank, lowered by torch (its constructor runs its checks)."""
    return cls(stand_in_stages(p, 2 * p), m, loss_fn=None, defer_pp_recv=defer_pp_recv)


def torch_dry_run(actions: dict, stage_to_rank, num_stages: int):
    """torch's own deadlock dry run of a compute+comms schedule (it takes no FSDP, REDUCE_GRAD or OVERLAP_F_B
    actions: an OVERLAP_F_B is given as its sub-actions, which torch's runtime runs one after the other)."""
    flat = {r: [s for a in acts for s in (a.sub_actions or (a,))] for r, acts in actions.items()}
    kept = {r: [a for a in acts if a.computation_type.value not in FSDP_ONLY + ("REDUCE_GRAD",)]
            for r, acts in flat.items()}
    return S._simulate_comms_compute(kept, lambda s: stage_to_rank[s], num_stages)


def read(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        return from_torch_csv(path, **kwargs)


def csv_rows(path, drop=()):
    with open(path, newline="") as f:
        return [[c for c in row if c and not c.endswith(drop)] for row in csv.reader(f)]


# torch's defer_pp_recv=True lowering, and the two messages our validator finds swapped: the send that is issued
# first and the receive its peer posts first instead (same shape for a model of equal-width layers)
DEFERRED = [
    (S.ScheduleZBVZeroBubble, 2, 3, "SEND_F0.2>1", "RECV_B2.0<0"),
    (S.ScheduleInterleavedZeroBubble, 2, 3, "SEND_B2.0>1", "RECV_F3.2<0"),
    (S.ScheduleDualPipeV, 3, 6, "SEND_F0.4>1", "RECV_B4.0<0"),
]


@pytest.mark.parametrize("cls, p, m, send, recv", DEFERRED, ids=[c[0].__name__ for c in DEFERRED])
def test_torch_defer_pp_recv_is_accepted_by_torch_and_rejected_by_pipesched(tmp_path, cls, p, m, send, recv):
    schedule = torch_schedule(cls, p, m, defer_pp_recv=True)
    order = schedule.pipeline_order_with_comms
    s2r = schedule.stage_index_to_group_rank
    S._validate_schedule(order, p, 2 * p, m)  # torch's checker accepts it (its constructor ran it too) ...
    torch_dry_run(order, s2r, 2 * p)  # ... and so does its dry run, which matches messages by kind, not in order
    schedule._dump_csv(tmp_path / "deferred.csv")
    program = read(tmp_path / "deferred.csv")
    with pytest.raises(ps.PairingError) as info:
        ps.validate(program)
    assert (info.value.rank, str(info.value.instr)) == (0, send)
    assert f"rank 0 sends {send} here, but rank 1's matching receive is {recv}" in info.value.reason
    # torch's default lowering of the same schedule posts the receives in order: valid
    torch_schedule(cls, p, m)._dump_csv(tmp_path / "default.csv")
    ps.validate(read(tmp_path / "default.csv"))


@pytest.mark.parametrize("cls, p, m", [(S.ScheduleZBVZeroBubble, 2, 3), (S.ScheduleInterleavedZeroBubble, 2, 3),
                                       (S.ScheduleDualPipeV, 3, 6), (S.ScheduleInterleaved1F1B, 4, 8)])
@pytest.mark.parametrize("defer", [False, True])
def test_torch_files_round_trip_through_pipesched(tmp_path, cls, p, m, defer):
    schedule = torch_schedule(cls, p, m, defer)
    schedule._dump_csv(tmp_path / "comms.csv")  # compute_comms, torch's default
    with pytest.warns(TorchCsvWarning, match=f"dropped {2 * p} UNSHARD, {2 * p} RESHARD: FSDP-only"):
        program = from_torch_csv(tmp_path / "comms.csv", dp_size=2)
    assert torch_rows(program) == csv_rows(tmp_path / "comms.csv", drop=FSDP_ONLY)  # REDUCE_GRAD as ALL_REDUCE
    schedule._dump_csv(tmp_path / "compute.csv", format="compute_only")
    assert torch_rows(read(tmp_path / "compute.csv")) == csv_rows(tmp_path / "compute.csv")
    if cls is S.ScheduleDualPipeV:
        assert any("OVERLAP_F_B" in a for row in torch_rows(program) for a in row)


PROGRAMS = [("1f1b", 4, 8, 1, False), ("gpipe", 2, 3, 1, False), ("interleaved-1f1b", 2, 3, 2, True),
            ("interleaved-1f1b", 4, 6, 2, False), ("1f1b", 3, 5, 1, True)]


@pytest.mark.parametrize("name, p, m, v, split", PROGRAMS)
@pytest.mark.parametrize("form", ["compute_only", "compute_comms"])
def test_our_programs_pass_torchs_checks_and_round_trip_through_its_reader_and_writer(tmp_path, name, p, m, v, split,
                                                                                        form):
    program = ps.compile_program(name, p, m, v, split_backward=split)
    to_torch_csv(program, tmp_path / "ours.csv", comms=form == "compute_comms")
    runtime = S._PipelineScheduleRuntime(stand_in_stages(p, p * v), m)
    runtime._load_csv(str(tmp_path / "ours.csv"), format=form)  # _validate_schedule; compute_only: its lowering
    assert runtime.stage_index_to_group_rank == dict(enumerate(program.stage_to_rank))
    torch_dry_run(runtime.pipeline_order_with_comms, program.stage_to_rank, program.num_stages)
    runtime._dump_csv(str(tmp_path / "torch.csv"), format=form)
    back = read(tmp_path / "torch.csv", schedule=name)
    if form == "compute_comms":
        assert back == program
    else:
        assert back.ranks == tuple(tuple(i for i in st if i.op in (Op.F, Op.B, Op.I, Op.W)) for st in program.ranks)
        ps.validate(read(tmp_path / "torch.csv"))


def test_the_readme_example_raises_the_error_it_shows(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("**Why it matters.**", 1)[1]
    code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ps.PairingError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TorchCsvWarning)
            exec(compile(code, "README.md", "exec"), {})
    first = " ".join(shown.split("\nstep", 1)[0].split())  # the README wraps the message's first line
    assert first == f"PairingError: {str(info.value).splitlines()[0]}"
