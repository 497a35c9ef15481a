"""Bad arguments to the torch-free API get a TypeError/ValueError naming the argument, its value and what is valid,
before anything is touched (trial F, bug4 and bug8): an int path is never taken as a file descriptor (open() would
read and then close the caller's descriptor), a string or dict where a Program or CostModel goes is not an
AttributeError from inside, and a JSON integer too long for Python is a ProgramFormatError naming the line."""
import json
import os
import tempfile
from pathlib import Path

import pytest

import pipesched as ps
from pipesched import lower
from pipesched.interop import from_torch_csv, to_torch_csv
from pipesched.profile import LayerProfile
from pipesched import strict_json

BIG = "1" + "0" * 5000  # past Python's int conversion limit (4300 digits)


def program():
    return ps.compile_program("1f1b", 2, 2)


def profile():
    return LayerProfile(forward=(1.0, 2.0), input_grad=(0.5, 1.0), weight_grad=(0.0, 1.0),
                        activation_bytes=(10.0, 20.0), output_bytes=(4.0, 8.0), param_bytes=(0.0, 100.0),
                        microbatch_size=2, input_bytes=6.0, latency=0.25, bandwidth=1000.0,
                        layer_names=("ReLU", "Linear"))


@pytest.fixture
def caller_file():
    """An open file of the caller's, holding one line: its descriptor is what a wrong call would read and close."""
    with tempfile.TemporaryFile("w+") as handle:
        handle.write("the caller's data\n")
        handle.flush()
        yield handle


READERS = [
    (ps.load, "path must be a str or os.PathLike, got int {fd}"),
    (from_torch_csv, "from_torch_csv: path must be a str or os.PathLike, got int {fd}"),
    (ps.Timeline.load, "path must be a str or os.PathLike, got int {fd}"),
    (LayerProfile.load, "path must be a str or os.PathLike, got int {fd}"),
]


@pytest.mark.parametrize("read, message", READERS, ids=["load", "from_torch_csv", "Timeline.load", "LayerProfile.load"])
def test_an_int_path_is_refused_and_the_callers_descriptor_stays_open(caller_file, read, message):
    fd = caller_file.fileno()
    with pytest.raises(TypeError) as info:
        read(fd)
    assert str(info.value) == message.format(fd=fd)
    os.fstat(fd)  # still open: raises OSError if the call closed it
    caller_file.seek(0)
    assert caller_file.read() == "the caller's data\n"


WRITERS = [
    (lambda fd: to_torch_csv(program(), fd), "to_torch_csv: path must be a str or os.PathLike, got int {fd}"),
    (lambda fd: ps.simulate(program()).save(fd), "path must be a str or os.PathLike, got int {fd}"),
    (lambda fd: profile().save(fd), "path must be a str or os.PathLike, got int {fd}"),
]


@pytest.mark.parametrize("write, message", WRITERS, ids=["to_torch_csv", "Timeline.save", "LayerProfile.save"])
def test_an_int_path_is_refused_by_the_writers_before_writing(caller_file, write, message):
    fd = caller_file.fileno()
    with pytest.raises(TypeError) as info:
        write(fd)
    assert str(info.value) == message.format(fd=fd)
    os.fstat(fd)
    caller_file.seek(0)
    assert caller_file.read() == "the caller's data\n"  # nothing written into the caller's file


@pytest.mark.filterwarnings("ignore::pipesched.interop.TorchCsvWarning")  # REDUCE_GRAD dropped (dp_size=1)
def test_paths_as_str_bytes_and_pathlib_still_work(tmp_path):
    prog = program()
    (tmp_path / "p.txt").write_text(ps.to_text(prog), encoding="utf-8")
    for path in (tmp_path / "p.txt", str(tmp_path / "p.txt"), os.fsencode(tmp_path / "p.txt")):
        assert ps.load(path) == prog
    to_torch_csv(prog, tmp_path / "p.csv")
    assert from_torch_csv(tmp_path / "p.csv").num_microbatches == 2
    timeline = ps.simulate(prog)
    timeline.save(tmp_path / "t.json")
    assert ps.Timeline.load(tmp_path / "t.json").makespan == timeline.makespan
    profile().save(tmp_path / "lp.json")
    assert LayerProfile.load(tmp_path / "lp.json") == profile()


NAME_HINT = " (a schedule name? compile it first: pipesched.compile_program('1f1b', num_ranks, num_microbatches))"
NOT_A_PROGRAM = [
    ("simulate", lambda: ps.simulate("1f1b"), "program must be a pipesched.Program, got str '1f1b'" + NAME_HINT),
    ("validate", lambda: ps.validate(3), "program must be a pipesched.Program, got int 3"),
    ("to_torch_csv", lambda: to_torch_csv("1f1b", "never-written.csv"),
     "to_torch_csv: program must be a pipesched.Program, got str '1f1b'" + NAME_HINT),
    ("to_text", lambda: ps.to_text(None), "program must be a pipesched.Program, got NoneType None"),
    ("to_json", lambda: ps.to_json([1, 2]), "program must be a pipesched.Program, got list [1, 2]"),
    ("step_programs", lambda: ps.step_programs("1f1b"),
     "program must be a pipesched.Program, got str '1f1b'" + NAME_HINT),
    ("split_backward", lambda: ps.split_backward(3), "program must be a pipesched.Program, got int 3"),
    ("add_recompute", lambda: ps.add_recompute(3), "program must be a pipesched.Program, got int 3"),
    ("add_send_recv", lambda: ps.add_send_recv(3), "program must be a pipesched.Program, got int 3"),
    ("add_all_reduce", lambda: ps.add_all_reduce(3, 2), "program must be a pipesched.Program, got int 3"),
    ("add_tie_reduce", lambda: ps.add_tie_reduce(3, [(0, 1)]), "program must be a pipesched.Program, got int 3"),
    ("forward_only", lambda: ps.forward_only(3), "program must be a pipesched.Program, got int 3"),
    ("post_receives_early", lambda: ps.post_receives_early(3), "program must be a pipesched.Program, got int 3"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in NOT_A_PROGRAM], ids=[c[0] for c in NOT_A_PROGRAM])
def test_a_program_argument_that_is_no_program_is_a_type_error_naming_it(tmp_path, monkeypatch, call, message):
    monkeypatch.chdir(tmp_path)  # to_torch_csv must not create its file either
    with pytest.raises(TypeError) as info:
        call()
    assert str(info.value) == message
    assert not (tmp_path / "never-written.csv").exists()


@pytest.mark.parametrize("call", [lambda c: ps.simulate(program(), c), lambda c: lower.add_send_recv(
    lower.add_all_reduce(ps.build("1f1b", 2, 2), 1), c)], ids=["simulate", "add_send_recv"])
def test_costs_that_are_no_cost_model_are_a_type_error_naming_them(call):
    with pytest.raises(TypeError) as info:
        call({"forward": 1})
    assert str(info.value) == ("cost must be a pipesched.CostModel or None (the default costs), got dict "
                               "{'forward': 1} (make one: pipesched.CostModel(**costs))")


def test_simulate_with_cost_none_and_a_cost_model_still_works():
    assert ps.simulate(program(), None).makespan == ps.simulate(program(), ps.CostModel()).makespan == 9.0


@pytest.mark.parametrize("v", ["1", 1.0, "2"])
def test_virtual_stages_not_an_integer_says_it_must_be_one(v):
    with pytest.raises(ps.ScheduleArgumentError) as info:
        ps.build("1f1b", 2, 2, v)
    assert str(info.value) == (f"virtual_stages must be an integer >= 1 or None (the schedule's default: 1 for "
                               f"'1f1b'), got {v!r}")
    assert info.value.argument == "virtual_stages"
    with pytest.raises(ps.ScheduleArgumentError, match="virtual_stages must be an integer >= 1 or None"):
        ps.compile_program("interleaved-1f1b", 2, 4, v)


def test_virtual_stages_as_a_numpy_integer_is_still_taken():
    np = pytest.importorskip("numpy")
    assert ps.build("interleaved-1f1b", 2, 4, np.int64(2)).num_stages == 4


def test_a_json_integer_too_long_for_python_names_its_line():
    text = ps.to_json(program(), indent=1).replace('"dp_size": 1', '"dp_size": ' + BIG)
    assert text.splitlines()[7].startswith(' "dp_size": 1000')  # line 8
    with pytest.raises(ps.ProgramFormatError) as info:
        ps.loads(text)
    assert str(info.value) == ("invalid JSON: an integer of 5001 digits, more than Python reads (at most 4300 "
                               "digits): line 8 column 13 (char 92)")


def test_a_long_digit_string_inside_a_json_string_is_not_the_integer_named():
    text = json.dumps({"schedule": BIG, "n": int("9" * 10)}).replace("9999999999", BIG)
    with pytest.raises(json.JSONDecodeError) as info:
        strict_json.loads(text)
    assert (info.value.lineno, info.value.colno) == (1, 14 + 5001 + 8 + 1)  # the integer after "n", not the string before it


def test_a_text_header_integer_too_long_for_python_is_a_program_format_error():
    text = ps.to_text(program()).replace("microbatches: 2", "microbatches: " + BIG)
    with pytest.raises(ps.ProgramFormatError) as info:
        ps.loads(text)
    assert str(info.value) == ("bad header value: microbatches: an integer of 5001 digits, more than Python reads "
                               "(at most 4300 digits)")


def test_a_timeline_file_with_a_too_long_integer_names_its_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"events": [],\n "num_ranks": ' + BIG + "}", encoding="utf-8")
    with pytest.raises(json.JSONDecodeError) as info:
        ps.Timeline.load(path)
    assert (info.value.lineno, info.value.colno) == (2, 15)


@pytest.mark.parametrize("text, message", [
    (b"{}", "text must be a str (a program's text or JSON form), got bytes b'{}' (to read a file, use "
            "pipesched.load(path))"),
    (Path("p.txt"), "text must be a str (a program's text or JSON form), got PosixPath PosixPath('p.txt') (to read "
                    "a file, use pipesched.load(path))"),
    (None, "text must be a str (a program's text or JSON form), got NoneType None"),
])
def test_loads_of_no_text_is_a_type_error(text, message):
    if os.name != "posix" and isinstance(text, Path):
        pytest.skip("the Path's class name differs")
    with pytest.raises(TypeError) as info:
        ps.loads(text)
    assert str(info.value) == message


def test_passes_for_an_unhashable_backend_names_the_known_ones():
    with pytest.raises(ValueError) as info:
        ps.passes_for(["gloo"])
    assert str(info.value) == "no passes are defined for backend ['gloo']; known: gloo, nccl"
