"""A file that is not JSON, given where a saved Timeline or LayerProfile is expected, is refused naming the file
and what writes such files (a new user's trial: `pipesched plan --profile notes.txt` said only "Expecting value:
line 1 column 1 (char 0)", Timeline.load raised json's bare message)."""
from __future__ import annotations

import json

import pytest

import pipesched as ps
from pipesched.cli import main


@pytest.fixture
def not_json(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not json\n", encoding="utf-8")
    return path


def test_timeline_load_names_the_file_and_the_writer(not_json):
    with pytest.raises(json.JSONDecodeError) as info:
        ps.Timeline.load(not_json)
    assert str(info.value) == (f"{not_json} is not JSON (Expecting value); expected a file written by "
                               f"Timeline.save: line 1 column 1 (char 0)")
    assert (info.value.lineno, info.value.colno) == (1, 1)


def test_layer_profile_load_names_the_file_and_the_writer(not_json):
    with pytest.raises(ValueError, match=r"is not JSON \(Expecting value\); expected a file written by "
                                         r"LayerProfile.save: line 1 column 1"):
        ps.LayerProfile.load(not_json)


def test_plan_names_the_option(not_json, capsys):
    assert main(["plan", "--profile", str(not_json), "--world-size", "2", "--memory", "16GiB", "--batch", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --profile: {not_json} is not JSON (Expecting value); expected a file written by LayerProfile.save: "
        f"line 1 column 1 (char 0)")


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "timeline.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    return path


@pytest.mark.parametrize("reader, writer", [(ps.Timeline.load, "Timeline.save"),
                                            (ps.LayerProfile.load, "LayerProfile.save")])
def test_a_binary_file_is_not_json_naming_the_file_and_the_writer(picture, reader, writer):
    # was a bare UnicodeDecodeError ('utf-8' codec can't decode byte 0x89 ...), no file named
    with pytest.raises(json.JSONDecodeError) as info:
        reader(picture)
    assert str(info.value) == (f"{picture}: not UTF-8 text: byte 0x89 at offset 0; expected a file written by "
                               f"{writer}: line 1 column 1 (char 0)")


def test_a_profile_giving_a_key_twice_names_the_file(tmp_path, capsys):
    path = tmp_path / "dup.json"
    path.write_text('{"a": 1, "a": 2}', encoding="utf-8")
    assert main(["plan", "--profile", str(path), "--world-size", "2", "--memory", "1GiB", "--batch", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f'error: --profile: {path}: duplicate key "a" at the top level (given twice: only the last would be kept); '
        f'give each key once')
