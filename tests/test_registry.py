"""User schedules (pipesched.registry) and user programs as a pipeline's schedule (pipesched.user_programs):
registration and its errors, entry points, the command line, a property test of the example builder."""
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import pipesched as ps
from pipesched import Registry, ScheduleArgumentError, UnknownScheduleError
from pipesched.cli import main
from pipesched.lower import add_send_recv
from pipesched.registry import REGISTRY
from pipesched.testing import check_program
from pipesched.user_programs import check_user_program, dp_size_for, program_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_MODULE = ROOT / "examples" / "chunked_gpipe.py"
HANDWRITTEN = ROOT / "schedules" / "examples" / "handwritten-1f1b-p2-m3.txt"
BROKEN = ROOT / "schedules" / "examples" / "broken-deadlock.txt"


def build_reversed_1f1b(p, m, v):
    """1F1B, built from the built-in."""
    return ps.build("1f1b", p, m, v)


@pytest.fixture
def clean_registry():
    """Leaves REGISTRY (and the imported example module) as it found them."""
    before = set(REGISTRY.registered())
    yield REGISTRY
    for name in set(REGISTRY.registered()) - before:
        REGISTRY.unregister(name)
    sys.modules.pop("chunked_gpipe", None)
    sys.modules.pop("ep_schedules", None)


@pytest.fixture(scope="module")
def chunked():
    """The example's builder, imported without registering into REGISTRY for good."""
    assert REGISTRY.import_module(str(EXAMPLE_MODULE)) == ("chunked-gpipe",)
    build = sys.modules.pop("chunked_gpipe").build_chunked_gpipe
    REGISTRY.unregister("chunked-gpipe")
    registry = Registry(entry_point_group=None)
    registry.register("chunked-gpipe", build, "example")
    return registry.get("chunked-gpipe")


# ---- registering -----------------------------------------------------------------------------------------------


def test_a_registered_name_works_wherever_a_name_does(clean_registry):
    info = ps.register_schedule("my-1f1b", build_reversed_1f1b, "1F1B again")
    assert ps.get_schedule("my-1f1b") is info and info.summary == "1F1B again"
    program = ps.compile_program("my-1f1b", 2, 3)
    assert program.schedule == "my-1f1b"  # the registered name labels the program
    assert program.ranks == ps.compile_program("1f1b", 2, 3).ranks
    assert ps.build("my-1f1b", 2, 2).schedule == "my-1f1b"
    assert "my-1f1b" in REGISTRY.all() and "my-1f1b" in str(_unknown("nope"))


def _unknown(name):
    with pytest.raises(UnknownScheduleError) as info:
        ps.get_schedule(name)
    return info.value


def test_registering_a_built_in_name_is_refused(clean_registry):
    with pytest.raises(ValueError, match=r"^schedule name '1f1b' is a built-in schedule and cannot be registered "
                                         r"again; built-in names: .*1f1b.*Choose another name$"):
        ps.register_schedule("1f1b", build_reversed_1f1b, "no")
    assert ps.get_schedule("1f1b").build is not build_reversed_1f1b
    with pytest.raises(ValueError, match="'gpipe' is a built-in schedule; only user schedules can be unregistered"):
        ps.unregister_schedule("gpipe")


@pytest.mark.parametrize("name, builder, description, error, message", [
    ("x", 3, "d", TypeError, "schedule 'x': builder must be callable as builder(num_ranks, num_microbatches, "
                             "virtual_stages) -> Program, got int"),
    ("x", build_reversed_1f1b, None, TypeError, "schedule 'x': description must be a string, got NoneType"),
    ("my sched", build_reversed_1f1b, "d", ValueError, "schedule name must be a string of letters, digits and "
                                                       "'._+-' starting with a letter or digit, got 'my sched'"),
    ("", build_reversed_1f1b, "d", ValueError, "got ''"),
])
def test_bad_registrations_are_clear_errors(clean_registry, name, builder, description, error, message):
    with pytest.raises(error) as info:
        ps.register_schedule(name, builder, description)
    assert message in str(info.value)
    assert set(REGISTRY.all()) == set(ps.SCHEDULES)


def test_a_second_registration_needs_replace_unless_identical(clean_registry):
    first = ps.register_schedule("twice", build_reversed_1f1b, "d")
    assert ps.register_schedule("twice", build_reversed_1f1b, "d") == first  # importing twice is fine
    with pytest.raises(ValueError, match=r"schedule 'twice' is already registered \(builder test_registry"
                                         r".build_reversed_1f1b\) with other fields \(only an identical "
                                         r"registration is a no-op\); pass replace=True"):
        ps.register_schedule("twice", lambda p, m, v: ps.build("gpipe", p, m, v), "other")
    ps.register_schedule("twice", lambda p, m, v: ps.build("gpipe", p, m, v), "other", replace=True)
    assert ps.build("twice", 2, 2).ranks == ps.build("gpipe", 2, 2).ranks


def test_a_builder_returning_something_else_is_a_clear_error(clean_registry):
    ps.register_schedule("not-a-program", lambda p, m, v: [[]], "d")
    with pytest.raises(TypeError, match=r"^schedule 'not-a-program': its builder test_registry.test_a_builder_returning_something_else_is_a_clear_error.<locals>.<lambda> "
                                        r"returned "
                                        r"list, not a pipesched.Program \(it must return the compute-only program\)$"):
        ps.compile_program("not-a-program", 2, 2)
    ps.register_schedule("wrong-m", lambda p, m, v: ps.build("1f1b", p, m + 1), "d")
    with pytest.raises(ScheduleArgumentError, match="asked for num_microbatches=2, its builder .* returned a program "
                                                    "with 3") as info:
        ps.compile_program("wrong-m", 2, 2)
    assert info.value.argument == "num_microbatches"
    ps.register_schedule("one-stage-per-rank", lambda p, m, v: ps.build("1f1b", p, m), "ignores v")
    with pytest.raises(ScheduleArgumentError, match="asked for virtual_stages=2, its builder .* returned a program "
                                                    "with 1") as info:
        ps.compile_program("one-stage-per-rank", 2, 2, virtual_stages=2)
    assert info.value.argument == "virtual_stages"
    ps.register_schedule("lowered", lambda p, m, v: ps.compile_program("1f1b", p, m), "d")
    with pytest.raises(ScheduleArgumentError, match="returned a program with SEND/RECV; a builder returns the "
                                                    "compute-only program"):
        ps.compile_program("lowered", 2, 2)


def test_sizes_are_checked_before_the_builder_runs(clean_registry):
    calls = []
    ps.register_schedule("counted", lambda p, m, v: calls.append((p, m, v)) or ps.build("1f1b", p, m), "d")
    with pytest.raises(ScheduleArgumentError, match=r"num_microbatches must be an integer >= 1, got 0"):
        ps.compile_program("counted", 2, 0)
    assert calls == []
    ps.compile_program("counted", 2, 1)
    assert calls == [(2, 1, 1)]


def test_a_registry_of_your_own_leaves_the_process_registry_alone():
    mine = Registry(entry_point_group=None)
    mine.register("private", build_reversed_1f1b, "d", default_virtual_stages=1)
    assert mine.get("private").build(2, 2, 1).schedule == "private"
    assert "private" not in REGISTRY.all()
    with pytest.raises(UnknownScheduleError, match="unknown schedule 'private'"):
        ps.get_schedule("private")
    mine.unregister("private")
    with pytest.raises(UnknownScheduleError, match="no user schedule 'private' is registered; registered: none"):
        mine.unregister("private")


# ---- entry points ----------------------------------------------------------------------------------------------


def _distribution(tmp_path, entry_points: str, module: str) -> Path:
    """A minimal installed distribution on ``tmp_path``: a module and a dist-info declaring entry points."""
    (tmp_path / "ep_schedules.py").write_text(module)
    info = tmp_path / "ep_schedules-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-schedules\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[pipesched.schedules]\n{entry_points}\n")
    return tmp_path


MODULE = '''import pipesched as ps

def build(p, m, v):
    """1F1B from an entry point."""
    return ps.build("1f1b", p, m, v)

def broken(p, m, v):
    raise RuntimeError("never")
'''


def test_an_entry_point_is_loaded_when_its_name_is_first_asked_for(tmp_path, monkeypatch, clean_registry):
    monkeypatch.syspath_prepend(str(_distribution(tmp_path, "ep-1f1b = ep_schedules:build", MODULE)))
    assert "ep-1f1b" in REGISTRY.names() and "ep_schedules" not in sys.modules  # known by name, not imported
    program = ps.compile_program("ep-1f1b", 2, 2)
    assert program.schedule == "ep-1f1b" and ps.get_schedule("ep-1f1b").summary == "1F1B from an entry point."
    code = main(["show", "ep-1f1b", "-p", "2", "-m", "2"])
    assert code == 0


def test_a_broken_entry_point_is_named(tmp_path, monkeypatch, clean_registry):
    monkeypatch.syspath_prepend(str(_distribution(tmp_path, "ep-gone = ep_schedules:missing", MODULE)))
    with pytest.raises(UnknownScheduleError, match=r"schedule 'ep-gone' comes from entry point 'ep-gone = "
                                                   r"ep_schedules:missing' \(group pipesched.schedules\), which "
                                                   r"failed to load: AttributeError"):
        ps.get_schedule("ep-gone")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "ep-gone" not in REGISTRY.all()
    assert any("ep-gone" in str(w.message) for w in caught)


# ---- the command line ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, first_line", [
    (["--schedule-module", "{module}", "list"], None),
    (["list", "--schedule-module", "{module}"], None),
    (["show", "chunked-gpipe", "-p", "2", "-m", "3", "--schedule-module", "{module}"],
     "# chunked-gpipe: p=2 m=3 stages=2 dp=1 instructions=24"),
    (["--schedule-module", "{module}", "show", "chunked-gpipe", "-p", "2", "-m", "3"],
     "# chunked-gpipe: p=2 m=3 stages=2 dp=1 instructions=24"),
    (["simulate", "chunked-gpipe", "-p", "4", "-m", "8", "--schedule-module", "{module}"],
     "chunked-gpipe: p=4 m=8 v=1 dp=1  costs: F=1 B=2"),
    (["render", "chunked-gpipe", "-p", "2", "-m", "4", "-o", "{out}", "--schedule-module", "{module}"],
     "wrote {out}: simulated timeline, bubble fraction 0.3333"),
])
def test_cli_schedule_module_registers_for_every_command(capsys, clean_registry, tmp_path, argv, first_line):
    assert "chunked-gpipe" not in REGISTRY.registered()
    out = tmp_path / "c.png"
    argv = [a.format(module=EXAMPLE_MODULE, out=out) for a in argv]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    if first_line is None:  # list: the built-ins, then the registered one
        assert lines[-1].split()[:4] == ["chunked-gpipe", "GPipe", "in", "chunks"]
    else:
        assert lines[0] == first_line.format(out=out)


def test_cli_simulates_the_registered_schedule(capsys, clean_registry):
    assert main(["simulate", "chunked-gpipe", "-p", "4", "-m", "8", "--schedule-module", str(EXAMPLE_MODULE)]) == 0
    assert "makespan         42 s" in capsys.readouterr().out  # two GPipe chunks of 4: 2 x (4 + 3) x (1 + 2)


def test_cli_bad_schedule_module_exits_2_naming_it(capsys):
    assert main(["--schedule-module", "no_such_module_xyz", "list"]) == 2
    assert capsys.readouterr().err == ("error: --schedule-module no_such_module_xyz: cannot import it: "
                                       "ModuleNotFoundError: No module named 'no_such_module_xyz'\n")
    assert main(["show", "no-such-schedule", "-p", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown schedule 'no-such-schedule'; valid names:" in err
    assert err.endswith("(a schedule of your own: import the module that registers it first, at the top of your "
                        "script, not under `if __name__ == '__main__':`: each rank process of launch() or torchrun "
                        "imports it afresh; on the command line, --schedule-module MODULE)\n")


# ---- property test of the example builder ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64))
def test_chunked_gpipe_is_valid_and_holds_at_most_p_in_flight(chunked, p, m):
    program = add_send_recv(chunked.build(p, m, 1))
    check_program(program)
    assert ps.simulate(program).peak_inflight == (min(p, m),) * p


# ---- user programs ---------------------------------------------------------------------------------------------


def test_a_user_program_is_validated_and_its_sizes_win():
    program = ps.load(HANDWRITTEN)
    assert check_user_program(program, 2, 1, None, 1) == program
    assert program_for(program, 2, 3, 1, 1) == program
    assert dp_size_for(program, 1) == 1 and dp_size_for("1f1b", 3) == 3
    with_dp = ps.loads(ps.to_text(ps.compile_program("1f1b", 1, 2, dp_size=2)))
    assert dp_size_for(with_dp, 1) == 2 and dp_size_for(with_dp, 2) == 2


def test_a_user_program_the_pipeline_cannot_run_is_refused_naming_why():
    program = ps.load(HANDWRITTEN)
    cases = [
        (dict(num_ranks=4), "the program has 2 ranks (num_ranks) but the pipeline has 4 (world size 4 / dp_size 1); "
                            "launch 2 x dp_size processes, or use a program for 4 ranks, or run 2 data-parallel "
                            "replicas of it: pipesched.add_all_reduce(program, 2) (a torch CSV: "
                            "from_torch_csv(..., dp_size=2))"),
        (dict(num_microbatches=4), "num_microbatches=4, but the program runs 3 microbatches "
                                   "(program.num_microbatches); leave num_microbatches at its default or pass 3"),
        (dict(virtual_stages=2), "virtual_stages=2, but the program places its 2 stages on its ranks as its "
                                 "stage_to_rank says ([1, 1] per rank); leave virtual_stages=None"),
        (dict(recompute=True), "recompute=True with a Program: the program's own R instructions decide it "
                               "(stages []); pass recompute=False, or apply pipesched.add_recompute"),
        (dict(split_backward=[True, False]), "split_backward=[True, False] with a Program: the program's own I "
                                             "instructions decide it"),
    ]
    for change, message in cases:
        args = dict(num_ranks=2, num_microbatches=1, virtual_stages=None, dp_size=1) | change
        with pytest.raises(ValueError) as info:
            check_user_program(program, **args)
        assert message in str(info.value), (change, str(info.value))
    with pytest.raises(ValueError) as info:  # the way out named: before, the advice was only to drop dp_size
        dp_size_for(program, 3)
    assert str(info.value) == ("dp_size=3, but the program runs 1 data-parallel replica (program.dp_size, no "
                               "ALL_REDUCE); add the replicas' all-reduce to it: pipesched.add_all_reduce(program, 3) "
                               "(a torch CSV: pipesched.interop.from_torch_csv(..., dp_size=3)), or leave dp_size at "
                               "its default")
    with_dp = ps.add_all_reduce(program, 2)
    with pytest.raises(ValueError, match=r"^dp_size=3, but the program runs 2 data-parallel replicas \(program"):
        dp_size_for(with_dp, 3)
    with pytest.raises(TypeError, match="schedule must be a schedule name .* or a lowered pipesched.Program, got int"):
        program_for(3, 2, 1, None, 1)


def test_programs_of_the_wrong_kind_are_refused():
    compute_only = ps.build("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"the program is compute-only \(no SEND/RECV\); lower it first"):
        check_user_program(compute_only, 2, 1, None, 1)
    assert check_user_program(ps.build("1f1b", 1, 2), 1, 1, None, 1).num_ranks == 1  # one rank: nothing to send
    with pytest.raises(ValueError, match="the program is forward-only"):
        check_user_program(ps.forward_only(ps.compile_program("1f1b", 2, 2)), 2, 1, None, 1)
    tied = ps.compile_program("1f1b", 2, 2, ties=[(0, 1)])  # checked against the model's ties by the Pipeline
    assert check_user_program(tied, 2, 1, None, 1) is tied  # (tests/test_cli_forms_and_ties.py, runtime/test_one_rank_and_user_ties.py)


def test_an_invalid_program_gets_the_validators_error():
    with pytest.raises(ps.DeadlockError) as info:
        check_user_program(ps.load(BROKEN), 2, 1, None, 1)
    with pytest.raises(ps.DeadlockError) as direct:
        ps.validate(ps.load(BROKEN))
    assert str(info.value) == str(direct.value)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_step_programs_of_a_loaded_program_equal_those_of_the_compiled_one(backend):
    for compiled in (ps.compile_program("interleaved-1f1b", 2, 4, 2), ps.compile_program("1f1b", 2, 4,
                                                                                         recompute=True,
                                                                                         split_backward=True)):
        loaded = check_user_program(ps.loads(ps.to_text(compiled)), 2, 1, None, 1)
        assert ps.step_programs(loaded, backend) == ps.step_programs(compiled, backend)
    handwritten = ps.step_programs(ps.load(HANDWRITTEN), backend)
    assert handwritten.learn_train == ps.load(HANDWRITTEN)  # a learning step runs the program as written
    assert handwritten.forward == ps.validate(ps.post_receives_early(ps.forward_only(ps.load(HANDWRITTEN)),
                                                                     handwritten.early_receives))


def test_a_users_faulty_builder_is_named_by_the_validator_not_a_deadlock(clean_registry, capsys):
    from pipesched import Instr, Op, Program

    def missing_last_b(p, m, v):  # the last rank forgets its last backward
        streams = [[i for mb in range(m) for i in (Instr(Op.F, r, mb), Instr(Op.B, r, mb))] for r in range(p)]
        streams[-1] = streams[-1][:-1]
        return Program(streams, stage_to_rank=tuple(range(p)), num_microbatches=m)

    ps.register_schedule("forgets-a-b", missing_last_b, "d")
    with pytest.raises(ps.ScheduleError, match=r"^rank 1, B1\.1: stage 1, microbatch 1: its backward is missing"):
        ps.compile_program("forgets-a-b", 2, 2)
    ps.register_schedule("returns-a-list", lambda p, m, v: [], "d")
    assert main(["show", "returns-a-list", "-p", "2", "-m", "2"]) == 2  # one line, no traceback
    assert capsys.readouterr().err == ("error: schedule 'returns-a-list': its builder test_registry.test_a_users_"
                                       "faulty_builder_is_named_by_the_validator_not_a_deadlock.<locals>.<lambda> "
                                       "returned list, not a pipesched.Program (it must return the compute-only "
                                       "program)\n")


def test_a_builder_placing_a_stage_on_no_rank_is_named_by_the_validator_not_an_index_error(clean_registry):
    # the lowering ran before the validator and raised IndexError / NoSuchStage (a hunt of user programs)
    from pipesched import Instr, Op, Program

    ps.register_schedule("bad-rank", lambda p, m, v: Program([[Instr(Op.F, 0, 0)], []], stage_to_rank=(0, 5),
                                                              num_microbatches=m), "d")
    with pytest.raises(ps.InvalidProgramError, match=r"^stage_to_rank names rank 5, but the program has ranks 0\.\.1$"):
        ps.compile_program("bad-rank", 2, 1)
    ps.register_schedule("bad-stage", lambda p, m, v: Program([[Instr(Op.F, 0, 0), Instr(Op.F, 7, 0)],
                                                                [Instr(Op.F, 1, 0)]], stage_to_rank=(0, 1),
                                                               num_microbatches=m), "d")
    with pytest.raises(ps.InvalidProgramError, match=r"^rank 0, F7\.0: stage 7 does not exist \(stages 0\.\.1\)"):
        ps.compile_program("bad-stage", 2, 1)
