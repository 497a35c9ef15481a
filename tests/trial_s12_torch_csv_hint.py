"""A torch.distributed.pipelining schedule CSV given where pipesched's text form is read (``ps.load``, ``ps.loads``,
``pipesched validate FILE`` without ``--torch-csv``) is refused with a hint naming the reader that takes it."""
import subprocess
import sys

import pytest

import pipesched as ps
from pipesched import ProgramFormatError
from pipesched.interop import from_torch_csv, to_torch_csv

HINT = "this looks like a torch.distributed.pipelining schedule CSV"


@pytest.mark.parametrize("text", [
    "0F0,0F1\n1F0,1B0\n",                                    # compute_only
    "0UNSHARD,3UNSHARD,0F0,0SEND_F0\n1RECV_F0,1F0\n",        # compute_comms, FSDP actions first
    "(0F5;5B2)OVERLAP_F_B,0F6\n",                            # an overlapped pair first
    "0F0\n",                                                 # one action, no comma
])
def test_torch_csv_row_gets_the_hint(text):
    with pytest.raises(ProgramFormatError, match=r"line 1: expected a header .*from_torch_csv.*--torch-csv FILE"):
        ps.loads(text)


@pytest.mark.parametrize("text", ["hello: world\n", "F0.0 B0.0\n", "F0,B1\n", "0.5F\n", "step  rank 0\n"])
def test_other_lines_do_not_get_the_hint(text):
    with pytest.raises(ProgramFormatError) as info:
        ps.loads(text)
    assert HINT not in str(info.value)


def test_cli_validate_names_torch_csv_for_a_written_csv(tmp_path):
    path = tmp_path / "zbv.csv"
    to_torch_csv(ps.compile_program("zbv", 2, 3), path)
    done = subprocess.run([sys.executable, "-m", "pipesched", "validate", str(path)], capture_output=True, text=True)
    assert done.returncode == 1
    assert HINT in done.stdout + done.stderr
    with pytest.warns(Warning):                              # the hinted reader does read it
        ps.validate(from_torch_csv(path))


OWN_HINT = "this looks like pipesched's own text or JSON form"


@pytest.mark.parametrize("form", ["text", "json"])
def test_own_form_read_as_torch_csv_gets_the_reverse_hint(tmp_path, form):
    program = ps.compile_program("zbv", 2, 3)
    path = tmp_path / f"zbv.{form}"
    path.write_text(ps.to_json(program) if form == "json" else str(program), encoding="utf-8")  # str: the text form
    with pytest.raises(ProgramFormatError, match=r"line 1, column 1 \(rank 0\): cannot read torch action") as info:
        from_torch_csv(path)
    assert OWN_HINT in str(info.value)
    done = subprocess.run([sys.executable, "-m", "pipesched", "validate", "--torch-csv", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert OWN_HINT in done.stdout + done.stderr
    assert ps.load(path).ranks == program.ranks                  # the hinted reader does read it


def test_a_bad_torch_action_gets_no_reverse_hint(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X1\n", encoding="utf-8")
    with pytest.raises(ProgramFormatError, match=r"column 2 .*'0X1'") as info:
        from_torch_csv(path)
    assert OWN_HINT not in str(info.value)
