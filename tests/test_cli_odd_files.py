"""Files the command line cannot use give one line naming the file and why, not a traceback (helper-70's trial, bug5):
a JSON program nested thousands deep (the decoder's recursion) and a ``--schedule-module`` that is not a .py file."""
import json

import pytest

from pipesched import strict_json
from pipesched.cli import main

DEEP = "[" * 100_000 + "]" * 100_000


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_of_a_deeply_nested_json_file_is_invalid_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text(DEEP)
    code, out, err = run(capsys, "validate", str(path))
    assert code == 1
    assert (out + err).strip() == (f"invalid: {path}: ProgramFormatError: invalid JSON: nested deeper than this reader "
                                   f"allows (Python's recursion limit): line 1 column 1 (char 0)")


def test_strict_json_turns_the_recursion_into_a_decode_error():
    with pytest.raises(json.JSONDecodeError, match=r"^nested deeper than this reader allows"):
        strict_json.loads(DEEP)
    assert strict_json.is_json(DEEP) is True  # JSON all the same: it takes the JSON path and gets the error above


def test_a_schedule_module_that_is_not_python_source_is_named(tmp_path, capsys):
    path = tmp_path / "hostname"
    path.write_text("box\n")
    code, _, err = run(capsys, "--schedule-module", str(path), "list")
    assert code == 2
    assert err.strip() == (f"error: --schedule-module {path}: cannot import it: ImportError: {path} is not a Python "
                           f"source file (.py): give a .py file or an importable module name")
