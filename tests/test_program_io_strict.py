"""The text and JSON readers are strict: integers are integers (not bools, floats or strings), lists are lists, and a
text header comes once, before the rank sections; every refusal is a ProgramFormatError naming the field or line,
the value and what is valid (new-user trial B, items 2 and 3)."""
import json

import pytest

import pipesched as ps
from pipesched import ProgramFormatError
from pipesched.cli import main
from pipesched.program_io import from_json_dict, to_json_dict

GOOD = to_json_dict(ps.compile_program("1f1b", 2, 2, dp_size=2, ties=[(0, 1)]))


def _edited(path, value) -> str:
    """GOOD's JSON with the field at ``path`` (keys and indices) set to ``value``."""
    data = json.loads(json.dumps(GOOD))
    node = data
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return json.dumps(data)


def test_the_good_program_reads_back():
    assert ps.loads(json.dumps(GOOD)) == ps.compile_program("1f1b", 2, 2, dp_size=2, ties=[(0, 1)])


@pytest.mark.parametrize("path, value, says", [
    (("ranks", 0, 0, "microbatch"), 0.0, "ranks[0][0].microbatch must be an integer >= 0, got 0.0"),
    (("ranks", 0, 0, "microbatch"), False, "ranks[0][0].microbatch must be an integer >= 0, got false"),
    (("ranks", 0, 0, "microbatch"), "0", 'ranks[0][0].microbatch must be an integer >= 0, got "0"'),
    (("ranks", 0, 0, "stage"), 0.0, "ranks[0][0].stage must be an integer >= 0, got 0.0"),
    (("ranks", 0, 0, "stage"), True, "ranks[0][0].stage must be an integer >= 0, got true"),
    (("ranks", 0, 1, "peer"), 1.0, "ranks[0][1].peer must be an integer >= 0, got 1.0"),
    (("ranks", 0, 0, "op"), 1, "ranks[0][0].op must be one of F, B, I, W, R, SEND_F"),
    (("ranks", 0, 0), ["F", 0, 0], 'ranks[0][0] must be an instruction object with at least "op" and "stage"'),
    (("ranks", 1), {"0": 1}, "ranks[1] must be a list of instruction objects"),
    (("num_microbatches",), 2.0, "num_microbatches must be an integer >= 1, got 2.0"),
    (("num_microbatches",), "2", 'num_microbatches must be an integer >= 1, got "2"'),
    (("num_microbatches",), True, "num_microbatches must be an integer >= 1, got true"),
    (("dp_size",), 1.5, "dp_size must be an integer >= 1, got 1.5"),
    (("dp_size",), 2.0, "dp_size must be an integer >= 1, got 2.0"),
    (("stage_to_rank",), "01", 'stage_to_rank must be a list of rank numbers (one per stage), got "01"'),
    (("stage_to_rank", 1), 1.0, "stage_to_rank[1] must be an integer >= 0, got 1.0"),
    (("stage_to_rank", 0), False, "stage_to_rank[0] must be an integer >= 0, got false"),
    (("ties", 0, 1), 1.0, "ties[0][1] must be an integer >= 0, got 1.0"),
    (("ties",), "0,1", 'ties must be a list of ties (lists of stage numbers), got "0,1"'),
    (("schedule",), 7, "schedule must be a string, got 7"),
    (("forward_only",), "false", "forward_only must be true or false, got 'false'"),
    (("overlap_pairs",), [[{"op": "F", "stage": 0, "microbatch": 1.0}]], "overlap_pairs[0][0].microbatch must be an"),
])
def test_json_refuses_a_wrong_type_naming_the_field_and_value(path, value, says):
    with pytest.raises(ProgramFormatError) as info:
        ps.loads(_edited(path, value))
    assert says in str(info.value)


def test_json_with_numpy_integers_from_python_reads_as_plain_ints():
    np = pytest.importorskip("numpy")
    data = json.loads(json.dumps(GOOD))
    data["num_microbatches"], data["stage_to_rank"] = np.int64(2), [np.int32(0), np.int64(1)]
    program = from_json_dict(data)
    assert program == ps.loads(json.dumps(GOOD)) and type(program.num_microbatches) is int
    assert all(type(r) is int for r in program.stage_to_rank)


def test_the_cli_refuses_a_float_microbatch_with_exit_1_and_no_traceback(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(_edited(("ranks", 0, 0, "microbatch"), 0.0))
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr()
    assert "ProgramFormatError" in out.out + out.err and "Traceback" not in out.out + out.err


TEXT = ps.to_text(ps.compile_program("1f1b", 2, 2))  # headers on lines 1-5 ("# pipesched program" first)


def _lines():
    return TEXT.splitlines()


def test_a_header_given_twice_is_refused_naming_both_lines():
    lines = _lines()
    lines.insert(5, "microbatches: 3")  # line 6, after dp_size
    with pytest.raises(ProgramFormatError, match=r"^line 6: header 'microbatches' given twice \(first on line 3\); "
                                                 r"give each header once$"):
        ps.loads("\n".join(lines))


def test_a_header_after_the_rank_sections_is_refused_naming_its_line():
    lines = _lines() + ["dp_size: 2"]
    first_rank = next(n for n, x in enumerate(lines, 1) if x.startswith("rank "))
    with pytest.raises(ProgramFormatError, match=rf"^line {len(lines)}: header 'dp_size: 2' after the rank sections "
                                                 rf"\(the first 'rank N:' is on line {first_rank}\); 'dp_size' is also "
                                                 rf"given on line 5; the headers come before"):
        ps.loads("\n".join(lines))
    lines = [x for x in _lines() if not x.startswith("dp_size")] + ["dp_size: 1"]  # not given before: misplaced all the same
    with pytest.raises(ProgramFormatError, match=r"header 'dp_size: 1' after the rank sections"):
        ps.loads("\n".join(lines))


@pytest.mark.parametrize("key, value, says", [
    ("microbatches", "2.0", "microbatches: '2.0' is not an integer >= 1"),
    ("microbatches", "1_0", "microbatches: '1_0' is not an integer >= 1"),
    ("microbatches", "+2", "microbatches: '+2' is not an integer >= 1"),
    ("microbatches", "\u0662", "microbatches: '\u0662' is not an integer >= 1"),  # ARABIC-INDIC DIGIT TWO
    ("microbatches", "0", "microbatches: '0' is not an integer >= 1"),
    ("dp_size", "1.5", "dp_size: '1.5' is not an integer >= 1"),
    ("dp_size", "true", "dp_size: 'true' is not an integer >= 1"),
    ("stage_to_rank", "0 1.0", "stage_to_rank: '1.0' is not an integer >= 0 (one rank number >= 0 per stage"),
    ("stage_to_rank", "0 -1", "stage_to_rank: '-1' is not an integer >= 0"),
])
def test_text_headers_take_ascii_integers_only(key, value, says):
    lines = [f"{key}: {value}" if x.startswith(f"{key}:") else x for x in _lines()]
    with pytest.raises(ProgramFormatError) as info:
        ps.loads("\n".join(lines))
    assert says in str(info.value)


def test_text_ties_take_integers_only():
    text = ps.to_text(ps.compile_program("1f1b", 2, 2, ties=[(0, 1)]))
    assert "ties: 0,1" in text and ps.loads(text).ties == ((0, 1),)
    with pytest.raises(ProgramFormatError, match="ties: '1.0' is not an integer >= 0"):
        ps.loads(text.replace("ties: 0,1", "ties: 0,1.0"))


def test_an_instruction_token_takes_ascii_digits_only():
    with pytest.raises(ProgramFormatError, match="line 3: cannot parse instruction 'F\u0660.0'"):
        ps.loads("microbatches: 1\nstage_to_rank: 0\nrank 0: F\u0660.0 B0.0\n")


def test_a_rank_line_takes_ascii_digits_only():
    with pytest.raises(ProgramFormatError, match="line 3: expected a header .* or 'rank N:', got 'rank \u0660: F0.0 B0.0'"):
        ps.loads("microbatches: 1\nstage_to_rank: 0\nrank \u0660: F0.0 B0.0\n")
