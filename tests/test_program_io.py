"""Program text and JSON forms: documented keys, round trips, errors with line numbers."""
import json

import pytest

from pipesched import ProgramFormatError, compile_program, loads, to_json, to_text


def test_json_form_has_the_documented_keys():
    data = json.loads(to_json(compile_program("1f1b", 2, 2)))
    assert data["num_microbatches"] == 2
    assert data["stage_to_rank"] == [0, 1]
    assert data["ranks"][0][0] == {"op": "F", "stage": 0, "microbatch": 0, "peer": None}
    assert data["ranks"][0][1] == {"op": "SEND_F", "stage": 0, "microbatch": 0, "peer": 1}


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 3)])
def test_round_trip_both_forms(name, v):
    program = compile_program(name, 3, 5, v, dp_size=2, recompute=True)
    assert loads(to_text(program)) == program
    assert loads(to_json(program)) == program


def test_text_form_accepts_several_instructions_per_line():
    program = loads("microbatches: 1\nstage_to_rank: 0\nrank 0: F0.0 B0.0\n")
    assert [str(i) for i in program.ranks[0]] == ["F0.0", "B0.0"]
    assert program.schedule == "custom" and program.dp_size == 1


def test_bad_token_names_the_line():
    with pytest.raises(ProgramFormatError, match="line 3: cannot parse instruction 'Q0.0'"):
        loads("microbatches: 1\nstage_to_rank: 0\nrank 0: F0.0 Q0.0\n")


def test_missing_header_is_named():
    with pytest.raises(ProgramFormatError, match="stage_to_rank"):
        loads("microbatches: 1\nrank 0: F0.0 B0.0\n")


def test_json_missing_key_is_named():
    with pytest.raises(ProgramFormatError, match="stage_to_rank"):
        loads('{"ranks": [], "num_microbatches": 1}')


def test_the_grid_of_show_is_refused_with_how_to_write_the_text_form(capsys):
    from pipesched.cli import main

    assert main(["show", "1f1b", "-p", "2", "-m", "2"]) == 0  # the default format: the grid
    grid = capsys.readouterr().out
    with pytest.raises(ProgramFormatError, match=r"line 2: .*got 'step .*looks like `pipesched show`'s grid.*"
                                                 r"--format text` or `--json`"):
        loads(grid)
