"""The JSON program reader refuses a key given twice in one object, anywhere in the document, naming the key and where
it is, and a JSON document that is not an object as JSON of the wrong shape (new-user trial E, items 3 and 12).

``json.loads`` keeps the last value of a repeated key without a word: a second ``"overlap_pairs": []`` after a
dualpipev program's real pairs loaded with no pairs and ``pipesched validate`` said valid; ``{"op": "B", "op": "F"}``
loaded as an F. A top-level list was read as the text form ("expected a header ... got '[{...'").
"""
import json

import pytest

import pipesched as ps
from pipesched import ProgramFormatError
from pipesched.cli import main
from pipesched.program_io import to_json, to_json_dict
from pipesched.strict_json import DuplicateKeyError, format_path, loads as strict_loads

TWICE = "(given twice: only the last would be kept); give each key once"
SHAPE = ("a program is a JSON object with the keys ranks, num_microbatches, stage_to_rank (and optionally schedule, "
         "dp_size, forward_only, ties, overlap_pairs), e.g. "
         '{"num_microbatches": 2, "stage_to_rank": [0, 1], "ranks": [[...], [...]]}')


def _dualpipev_text() -> str:
    return to_json(ps.compile_program("dualpipev", 2, 4))


def _refusal(text: str) -> str:
    with pytest.raises(ProgramFormatError) as info:
        ps.loads(text)
    return str(info.value)


def test_a_second_empty_overlap_pairs_is_refused_not_dropping_every_pair():
    text = _dualpipev_text()
    assert json.loads(text)["overlap_pairs"]  # the pairs a second, empty value would have dropped
    assert text.endswith("}]]}")
    doubled = text[:-1] + ', "overlap_pairs": []}'
    assert json.loads(doubled)["overlap_pairs"] == []  # what json.loads alone makes of it
    assert _refusal(doubled) == f'JSON program: duplicate key "overlap_pairs" at the top level {TWICE}'


def test_an_instruction_giving_op_twice_is_refused_naming_the_instruction():
    text = to_json(ps.compile_program("1f1b", 2, 2))
    assert text.count('{"op": "F", "stage": 0, "microbatch": 0') == 1
    doubled = text.replace('{"op": "F", "stage": 0, "microbatch": 0', '{"op": "B", "op": "F", "stage": 0, '
                           '"microbatch": 0', 1)
    assert _refusal(doubled) == f'JSON program: duplicate key "op" in ranks[0][0] {TWICE}'


@pytest.mark.parametrize("path, key, where", [
    (("ranks", 1, 3), "peer", "ranks[1][3]"),
    (("ranks", 0, 5), "microbatch", "ranks[0][5]"),
    (("overlap_pairs", 0, 1), "stage", "overlap_pairs[0][1]"),
])
def test_a_repeated_key_anywhere_is_named_with_its_place(path, key, where):
    data = to_json_dict(ps.compile_program("dualpipev", 2, 4))
    node = data
    for step in path:
        node = node[step]
    marker = "__repeat_here__"
    node[marker] = None
    text = json.dumps(data).replace(f'"{marker}": null', f'"{key}": {json.dumps(node[key])}')
    assert _refusal(text) == f'JSON program: duplicate key "{key}" in {where} {TWICE}'


def test_a_key_given_three_times_and_several_repeated_keys():
    text = to_json(ps.compile_program("1f1b", 2, 2))
    thrice = text.replace('"dp_size": 1', '"dp_size": 1, "dp_size": 2, "dp_size": 1', 1)
    assert _refusal(thrice) == ('JSON program: duplicate key "dp_size" at the top level (given 3 times: only the last '
                                'would be kept); give each key once')
    both = text.replace('"dp_size": 1', '"schedule": "x", "dp_size": 1, "dp_size": 1', 1)
    assert _refusal(both) == f'JSON program: duplicate key "schedule" at the top level {TWICE}'  # the first named


def test_the_outer_repeat_is_named_when_its_dropped_value_held_another():
    # the first "ranks" (with a repeated "op" inside) is what the second "ranks" would drop: the outer repeat is named
    text = to_json(ps.compile_program("1f1b", 2, 2))
    ranks = json.dumps(json.loads(text)["ranks"])
    bad_ranks = ranks.replace('{"op": "F"', '{"op": "F", "op": "F"', 1)
    doubled = text.replace('"ranks": ', f'"ranks": {bad_ranks}, "ranks": ', 1)
    assert _refusal(doubled) == f'JSON program: duplicate key "ranks" at the top level {TWICE}'


def test_the_same_value_given_twice_is_refused_too():
    # no harm done here, but a reader cannot tell a copy from an edit the author forgot: one rule, no exceptions
    text = to_json(ps.compile_program("1f1b", 2, 2)).replace('"dp_size": 1', '"dp_size": 1, "dp_size": 1')
    assert _refusal(text) == f'JSON program: duplicate key "dp_size" at the top level {TWICE}'


def test_programs_without_repeats_still_read_back():
    for name, kw in (("dualpipev", {}), ("1f1b", {"ties": [(0, 1)], "dp_size": 2}), ("zbv", {"forward_only": True})):
        program = ps.compile_program(name, 2, 4, **kw)
        assert ps.loads(to_json(program)) == program
        assert ps.loads(to_json(program, indent=2)) == program


def test_validate_exits_1_on_the_trials_file(tmp_path, capsys):
    text = _dualpipev_text()
    path = tmp_path / "dualpipev-dupkey.json"
    path.write_text(text[:-1] + ', "overlap_pairs": []}')
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().err == (f'invalid: {path}: ProgramFormatError: JSON program: duplicate key '
                                       f'"overlap_pairs" at the top level {TWICE}\n')
    assert main(["validate", "--json", str(path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["valid"], out["error"]) == (False, "ProgramFormatError")
    assert out["reason"] == f'JSON program: duplicate key "overlap_pairs" at the top level {TWICE}'


# --- JSON of the wrong shape --------------------------------------------------------------------------------

def test_a_list_holding_a_program_is_json_of_the_wrong_shape_not_a_text_header_error():
    data = to_json_dict(ps.compile_program("1f1b", 2, 2))
    assert _refusal(json.dumps([data])) == (
        "JSON program of the wrong shape: the JSON is a list of 1 item (a list holding a program? write the "
        f"program's object itself, one program per file); {SHAPE}")
    assert _refusal("  \n" + json.dumps([data, data], indent=2)) == (
        "JSON program of the wrong shape: the JSON is a list of 2 items (a list holding a program? write the "
        f"program's object itself, one program per file); {SHAPE}")


@pytest.mark.parametrize("text, kind", [
    ("[]", "an empty list"),
    ("[1, 2]", "a list of 2 items"),
    ('[["F0.0"]]', "a list of 1 item"),
])
def test_other_lists_are_json_of_the_wrong_shape(text, kind):
    assert _refusal(text) == f"JSON program of the wrong shape: the JSON is {kind}; {SHAPE}"


def test_a_broken_list_is_invalid_json_and_a_repeat_inside_a_list_is_named():
    assert _refusal("[{").startswith("invalid JSON: ")
    assert _refusal('[{"a": 1, "a": 2}]') == f'JSON program: duplicate key "a" in [0] {TWICE}'


def test_validate_names_the_shape(tmp_path, capsys):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([to_json_dict(ps.compile_program("1f1b", 2, 2))]))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"invalid: {path}: ProgramFormatError: JSON program of the wrong shape: the JSON is a "
                          f"list of 1 item")
    assert "expected a header" not in err


def test_the_text_form_is_still_read_as_text():
    program = ps.compile_program("1f1b", 2, 2)
    assert ps.loads(ps.to_text(program)) == program
    with pytest.raises(ProgramFormatError, match=r"line 1: expected a header .* got 'hello'"):
        ps.loads("hello\n")


# --- the helper itself ----------------------------------------------------------------------------------------

def test_strict_loads_equals_json_loads_without_repeats():
    text = '{"a": [1, {"b": null, "c": [true, 2.5, "x"]}], "d": {}, "e": [], "a b": {"a": 1}}'
    assert strict_loads(text) == json.loads(text)
    assert type(strict_loads(text)["a"][1]) is dict
    assert strict_loads("[1, 2]") == [1, 2] and strict_loads('"s"') == "s"


def test_strict_loads_names_key_times_and_path():
    with pytest.raises(DuplicateKeyError) as info:
        strict_loads('{"meta": {"x": [0, {"ok": 1}, {"k": 1, "j": 2, "k": 3, "k": 4}]}}')
    exc = info.value
    assert isinstance(exc, ValueError)
    assert (exc.key, exc.times, exc.path, exc.where) == ("k", 3, ("meta", "x", 2), "in meta.x[2]")
    assert str(exc) == 'duplicate key "k" in meta.x[2] (given 3 times: only the last would be kept); give each key once'


def test_format_path():
    assert format_path(()) == ""
    assert format_path(("ranks", 0, 3, "op")) == "ranks[0][3].op"
    assert format_path((0, "a b", 1)) == '[0]["a b"][1]'
