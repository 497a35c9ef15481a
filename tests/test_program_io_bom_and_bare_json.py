"""A program file that starts with a UTF-8 byte order mark (Windows Notepad writes one) is read in its form, the mark
skipped; a file holding a bare JSON number, string, true, false or null is refused as JSON of the wrong shape.

Both went to the text reader before: ``line 1: expected a header (schedule, ...) or 'rank N:', got '\\ufeff{"num_...'``
for a valid JSON program, ``... got '42'`` for a number, errors that said nothing of JSON.
"""
import json

import pytest

import pipesched as ps
from pipesched import ProgramFormatError
from pipesched.cli import main
from pipesched.program_io import to_json
from pipesched.strict_json import DuplicateKeyError, is_json, loads as strict_loads
from pipesched.timeline import Timeline

BOM = "\ufeff"
SHAPE = ("a program is a JSON object with the keys ranks, num_microbatches, stage_to_rank (and optionally schedule, "
         "dp_size, forward_only, ties, overlap_pairs), e.g. "
         '{"num_microbatches": 2, "stage_to_rank": [0, 1], "ranks": [[...], [...]]}')
HEADER = ("expected a header (schedule, microbatches, stage_to_rank, dp_size, forward_only, ties, overlap_pairs) or "
          "'rank N:'")


def _refusal(text: str) -> str:
    with pytest.raises(ProgramFormatError) as info:
        ps.loads(text)
    return str(info.value)


# --- a byte order mark ------------------------------------------------------------------------------------------

def test_a_json_program_after_a_byte_order_mark_is_read_as_json(tmp_path):
    program = ps.compile_program("1f1b", 2, 4)
    assert ps.loads(BOM + to_json(program)) == program
    assert ps.loads(BOM + to_json(program, indent=2)) == program
    path = tmp_path / "bom.json"
    path.write_text(to_json(program), encoding="utf-8-sig")
    assert path.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert ps.load(path) == program


def test_the_text_form_after_a_byte_order_mark_is_read_as_text(tmp_path):
    program = ps.compile_program("interleaved-1f1b", 2, 4, 2)
    path = tmp_path / "bom.txt"
    path.write_text(ps.to_text(program), encoding="utf-8-sig")
    assert ps.load(path) == program


def test_after_a_byte_order_mark_the_json_checks_still_hold():
    text = to_json(ps.compile_program("1f1b", 2, 2))
    doubled = text[:-1] + ', "dp_size": 1}'
    assert _refusal(BOM + doubled) == ('JSON program: duplicate key "dp_size" at the top level (given twice: only '
                                       'the last would be kept); give each key once')
    assert _refusal(BOM + "[]") == f"JSON program of the wrong shape: the JSON is an empty list; {SHAPE}"
    assert _refusal(BOM + "{").startswith("invalid JSON: ")


def test_validate_reads_a_json_file_with_a_byte_order_mark(tmp_path, capsys):
    path = tmp_path / "bom.json"
    path.write_text(to_json(ps.compile_program("1f1b", 2, 4)), encoding="utf-8-sig")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"valid: {path}: 2 ranks, 2 stages, 4 microbatches, ")
    assert main(["validate", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["valid"], data["ranks"], data["num_microbatches"]) == (True, 2, 4)


def test_the_json_reader_skips_a_byte_order_mark(tmp_path):
    assert strict_loads(BOM + '{"a": [1, "x"]}') == {"a": [1, "x"]}
    assert strict_loads(BOM + "42") == 42
    with pytest.raises(DuplicateKeyError):
        strict_loads(BOM + '{"a": 1, "a": 2}')
    timeline = ps.simulate(ps.compile_program("1f1b", 2, 4))
    path = tmp_path / "timeline.json"
    timeline.save(path)
    path.write_text(path.read_text(encoding="utf-8"), encoding="utf-8-sig")
    assert Timeline.load(path).to_json_dict() == timeline.to_json_dict()


def test_is_json():
    for text in ("42", "-1.5e3", '"s"', "true", "null", " [1] ", '{"a": 1}', BOM + "7", '{"a": 1, "a": 2}'):
        assert is_json(text), text
    for text in ("", "hello", "42\nrank 0: F0.0", "{", "schedule: 1f1b", "# pipesched program"):
        assert not is_json(text), text


# --- a bare JSON value ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kind", [
    ("42", "a number"),
    ("-1.5e3\n", "a number"),
    ("  7  \n", "a number"),
    (BOM + "3", "a number"),
    ('"hello"', "a string"),
    ('"rank 0: F0.0"\n', "a string"),
    ("true", "true or false"),
    ("false\n", "true or false"),
    ("null", "null"),
])
def test_a_bare_json_value_is_json_of_the_wrong_shape(text, kind):
    assert _refusal(text) == f"JSON program of the wrong shape: the JSON is {kind}; {SHAPE}"


@pytest.mark.parametrize("content, kind", [("42\n", "a number"), ('"a program"\n', "a string"), ("null", "null")])
def test_validate_names_the_file_and_what_a_program_is(tmp_path, capsys, content, kind):
    path = tmp_path / "bare.json"
    path.write_text(content)
    assert main(["validate", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"invalid: {path}: ProgramFormatError: JSON program of the wrong shape: the JSON is "
                            f"{kind}; {SHAPE}\n")
    assert captured.out == ""
    assert main(["validate", "--json", str(path)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["valid"], data["error"]) == (False, "ProgramFormatError")
    assert data["reason"] == f"JSON program of the wrong shape: the JSON is {kind}; {SHAPE}"


def test_text_that_is_not_json_is_still_read_as_text():
    assert _refusal("hello\n") == f"line 1: {HEADER}, got 'hello'"
    assert _refusal("42\nrank 0: F0.0 B0.0\n") == f"line 1: {HEADER}, got '42'"
    assert _refusal("") == "missing header line 'microbatches: ...'"
    program = ps.compile_program("1f1b", 2, 2)
    assert ps.loads(ps.to_text(program)) == program
