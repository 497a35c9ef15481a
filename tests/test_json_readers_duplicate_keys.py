"""The other JSON files a user may write or edit refuse a key given twice, as the program reader does (new-user trial
E, item 3): a saved Timeline (``Timeline.load``, ``pipesched render --trace``) and a LayerProfile
(``LayerProfile.load``, ``pipesched plan --profile``). ``json.load`` would keep the last value: a second
``"events": []`` read as an empty run, a second ``"latency"`` planned with the wrong latency."""
import json

import pytest

import pipesched as ps
from pipesched.ir import Instr
from pipesched.profile import LayerProfile
from pipesched.strict_json import DuplicateKeyError
from pipesched.timeline import Event, Timeline

TWICE = "(given twice: only the last would be kept); give each key once"


def measured_like() -> Timeline:
    """A 2-rank, 1-microbatch run as the runtime saves it (1f1b, times in seconds)."""
    rows = [(0, "F0.0", 0.0, 1.0), (0, "SEND_F0.0>1", 1.0, 1.0), (0, "RECV_B0.0<1", 1.0, 4.5), (0, "B0.0", 4.5, 6.5),
            (1, "RECV_F1.0<0", 0.0, 1.5), (1, "F1.0", 1.5, 2.5), (1, "B1.0", 2.5, 4.5), (1, "SEND_B1.0>0", 4.5, 4.5)]
    return Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), 2, source="measured",
                    meta={"schedule": "1f1b", "ranks": 2, "microbatches": 1})


def _append_key(text: str, pair: str) -> str:
    """``text`` (one JSON object) with ``"key": value`` added as its last member."""
    body = text.rstrip()
    assert body.endswith("}")
    return body[:-1] + ", " + pair + "}\n"


def test_timeline_load_refuses_a_second_events(tmp_path):
    path = tmp_path / "run.json"
    measured_like().save(path)
    assert Timeline.load(path) == measured_like()  # unchanged without repeats
    path.write_text(_append_key(path.read_text(), '"events": []'))
    assert Timeline.from_json_dict(json.loads(path.read_text())).events == ()  # what json.load alone gives
    with pytest.raises(DuplicateKeyError) as info:
        Timeline.load(path)
    assert str(info.value) == f'duplicate key "events" at the top level {TWICE}'
    assert isinstance(info.value, ValueError)


def test_timeline_load_names_a_repeat_inside_meta(tmp_path):
    path = tmp_path / "run.json"
    timeline = ps.simulate(ps.compile_program("1f1b", 2, 2), ps.CostModel())
    timeline.save(path)
    text = path.read_text()
    assert text.count('"meta": {') == 1
    path.write_text(text.replace('"meta": {', '"meta": {"schedule": "gpipe", ', 1))
    with pytest.raises(DuplicateKeyError, match=r'^duplicate key "schedule" in meta \(given twice'):
        Timeline.load(path)


def test_render_trace_exits_2_naming_the_file_and_the_key(tmp_path, capsys):
    from pipesched.viz.cli import main

    path = tmp_path / "run.json"
    measured_like().save(path)
    path.write_text(_append_key(path.read_text(), '"num_ranks": 1'))
    out = tmp_path / "x.json"
    assert main(["render", "--trace", str(path), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f'error: render: {path}: duplicate key "num_ranks" at the top level {TWICE}\n'
    assert not out.exists()


def _profile() -> LayerProfile:
    return LayerProfile(forward=(1.0, 2.0), input_grad=(0.5, 1.0), weight_grad=(0.0, 1.0),
                        activation_bytes=(10.0, 20.0), output_bytes=(4.0, 8.0), param_bytes=(0.0, 100.0),
                        microbatch_size=2, latency=0.25, bandwidth=1000.0)


def test_layer_profile_load_refuses_a_repeated_key_naming_the_file(tmp_path):
    path = tmp_path / "profile.json"
    _profile().save(path)
    assert LayerProfile.load(path) == _profile()
    path.write_text(_append_key(path.read_text(), '"latency": 0.0'))
    assert LayerProfile.from_json(json.loads(path.read_text())).latency == 0.0  # what json.loads alone gives
    with pytest.raises(ValueError) as info:
        LayerProfile.load(path)
    assert str(info.value) == f'{path}: duplicate key "latency" at the top level {TWICE}'


def test_plan_exits_2_on_a_profile_with_a_repeated_key(tmp_path, capsys):
    from pipesched.cli import main

    path = tmp_path / "profile.json"
    _profile().save(path)
    path.write_text(path.read_text().replace('"format": ', '"version": 1, "format": ', 1))
    code = main(["plan", "--profile", str(path), "--world-size", "2", "--memory", "1GiB", "--batch", "4"])
    assert code == 2
    assert f'{path}: duplicate key "version" at the top level {TWICE}' in capsys.readouterr().err
