"""The JSON program reader refuses an unknown key, at the top level and in every instruction object, naming the key,
where it is and the valid keys, as the text reader refuses an unknown header line (new-user trial D, item 6: a
dualpipev program with the typo "overlap_pair" validated and silently lost its overlapped pairs). Every JSON form
the project writes still reads back."""
import json

import pytest

import pipesched as ps
from pipesched import ProgramFormatError
from pipesched.cli import main
from pipesched.program_io import from_json_dict, to_json, to_json_dict, to_text
from pipesched.registry import REGISTRY

TOP = ("schedule, num_microbatches, stage_to_rank, dp_size, ranks, forward_only, ties, overlap_pairs")
INSTR = "op, stage, microbatch, peer"


def _dualpipev():
    return to_json_dict(ps.compile_program("dualpipev", 2, 4))


def _refusal(data) -> str:
    with pytest.raises(ProgramFormatError) as info:
        ps.loads(json.dumps(data))
    return str(info.value)


def test_a_misspelt_overlap_pairs_is_refused_not_dropped():
    data = _dualpipev()
    assert data["overlap_pairs"]  # the pairs the typo would have lost
    data["overlap_pair"] = data.pop("overlap_pairs")
    assert _refusal(data) == (f'JSON program: unknown key "overlap_pair" at the top level (did you mean '
                              f'"overlap_pairs"?); a program\'s keys are {TOP}')


def test_a_misspelt_ties_is_refused():
    data = to_json_dict(ps.compile_program("1f1b", 2, 2, ties=[(0, 1)]))
    data["ties_"] = data.pop("ties")
    assert _refusal(data) == (f'JSON program: unknown key "ties_" at the top level (did you mean "ties"?); '
                              f'a program\'s keys are {TOP}')


def test_several_unknown_keys_are_all_named_and_a_typo_of_a_required_key_is_named_before_it_is_missed():
    data = to_json_dict(ps.compile_program("1f1b", 2, 2))
    data["num_microbatch"] = data.pop("num_microbatches")
    data["comment"] = "hand-edited"
    assert _refusal(data) == (f'JSON program: unknown keys "num_microbatch", "comment" at the top level (did you mean '
                              f'"num_microbatches"?); a program\'s keys are {TOP}')


@pytest.mark.parametrize("path, key, where, hint", [
    (("ranks", 1, 2), "micro_batch", "ranks[1][2]", ' (did you mean "microbatch"?)'),
    (("ranks", 0, 0), "note", "ranks[0][0]", ""),
    (("overlap_pairs", 0, 1), "peers", "overlap_pairs[0][1]", ' (did you mean "peer"?)'),
])
def test_an_unknown_key_of_an_instruction_is_refused_naming_its_place(path, key, where, hint):
    data = _dualpipev()
    node = data
    for step in path:
        node = node[step]
    node[key] = 1
    assert _refusal(data) == f'JSON program: unknown key "{key}" in {where}{hint}; an instruction\'s keys are {INSTR}'


def test_a_non_string_key_from_python_is_refused_too():
    data = to_json_dict(ps.compile_program("1f1b", 2, 2))
    data[7] = "x"
    with pytest.raises(ProgramFormatError) as info:
        from_json_dict(data)
    assert str(info.value).startswith("JSON program: unknown key 7 at the top level; a program's keys are")


def test_validate_exits_1_naming_the_key(tmp_path, capsys):
    data = _dualpipev()
    data["overlap_pair"] = data.pop("overlap_pairs")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(data))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"invalid: {path}: ProgramFormatError: JSON program: unknown key \"overlap_pair\" at the "
                          f"top level")


def test_every_json_form_the_project_writes_reads_back(capsys):
    """Every schedule (built-in and of entry points), with each pass, as to_json / to_json_dict / show --json write it,
    and the README's example object, read back equal (optional keys included: forward_only, ties, overlap_pairs)."""
    seen = set()
    for name in REGISTRY.all():
        for kw in ({}, {"recompute": True}, {"split_backward": True}, {"forward_only": True}, {"dp_size": 2},
                   {"ties": [(0, 1)]}):
            try:
                program = ps.compile_program(name, 2, 4, **kw)
            except (ps.ScheduleError, ValueError):  # a size or pass this schedule does not take
                continue
            for text in (to_json(program), to_json(program, indent=2), json.dumps(to_json_dict(program))):
                assert ps.loads(text) == program, (name, kw)
            seen.update(to_json_dict(program))
    assert seen == set(TOP.split(", "))  # every top-level key the writer uses is one the reader takes
    assert main(["show", "dualpipev", "-p", "2", "-m", "4", "--json"]) == 0
    assert ps.loads(capsys.readouterr().out) == ps.compile_program("dualpipev", 2, 4)
    readme = {"ranks": [[{"op": "F", "stage": 0, "microbatch": 0, "peer": None}]], "num_microbatches": 1,
              "stage_to_rank": [0], "dp_size": 1}
    assert from_json_dict(readme).num_microbatches == 1
    short = {"ranks": [[{"op": "F", "stage": 0, "microbatch": 0}]], "num_microbatches": 1,  # optional keys left out
             "stage_to_rank": [0]}
    assert from_json_dict(short) == from_json_dict(readme)


def test_the_text_reader_still_refuses_an_unknown_header():
    text = to_text(ps.compile_program("1f1b", 2, 2)).replace("dp_size: 1", "dp_sizes: 1")
    with pytest.raises(ProgramFormatError, match="line 5: expected a header"):
        ps.loads(text)
