"""render and the gallery refuse what they would ignore or lose, with one line naming the option and exit 2:
``render --trace F -o F`` (the measured run would be overwritten), schedule/cost options with ``--trace``,
``--mode`` without ``--compare``, ``--as-recorded`` without ``--trace``, ``--dpi`` out of range, and a gallery
``--measured`` file that cannot be drawn (checked before anything is written)."""
import os

import pytest

from pipesched import Timeline, compile_program, simulate
from pipesched.cli import main

pytest.importorskip("matplotlib")


def _saved(tmp_path, name="run.json", ranks=None):
    """A measured-like 1f1b timeline (p=2, m=4) saved as ``name``; ``ranks``: keep only those ranks."""
    full = simulate(compile_program("1f1b", 2, 4))
    events = full.events if ranks is None else tuple(e for e in full.events if e.rank in ranks)
    path = tmp_path / name
    Timeline(events, 2, "measured", dict(full.meta), full.peak_inflight,
             ranks=None if ranks is None else tuple(ranks)).save(path)
    return path


def _err(capsys):
    out = capsys.readouterr()
    return out.err.strip().splitlines()[-1]


def test_render_refuses_to_overwrite_the_trace_it_draws(tmp_path, capsys, monkeypatch):
    saved = _saved(tmp_path)
    before = saved.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["render", "--trace", "run.json", "-o", "run.json"]) == 2
    assert _err(capsys) == ("error: render: -o/--output run.json is the --trace file run.json: writing it would "
                            "replace the measured run; choose another output file")
    os.mkdir("sub")
    assert main(["render", "--trace", "run.json", "-o", "sub/../run.json"]) == 2  # the same file by another path
    assert "-o/--output sub/../run.json is the --trace file run.json" in _err(capsys)
    if hasattr(os, "symlink"):
        os.symlink("run.json", "link.json")
        assert main(["render", "--trace", "link.json", "-o", "run.json"]) == 2
        assert "-o/--output run.json is the --trace file link.json" in _err(capsys)
    assert saved.read_bytes() == before
    assert main(["render", "--trace", "run.json", "-o", "run.png"]) == 0  # another file is fine


def test_render_trace_refuses_schedule_and_cost_options(tmp_path, capsys):
    saved = _saved(tmp_path)
    out = tmp_path / "c.png"
    assert main(["render", "--trace", str(saved), "--compare", "--latency", "5", "--forward", "100", "-p", "7",
                 "-m", "3", "--dp", "4", "--recompute", "-o", str(out)]) == 2
    assert _err(capsys) == (
        f"error: render: --trace {saved} draws the saved run: its program (and, with --compare, the costs fitted "
        f"from it) comes from the file, so render would ignore --ranks 7, --microbatches 3, --dp 4, --recompute, "
        f"--forward 100, --latency 5; drop them (schedule and cost options are for render SCHEDULE)")
    assert main(["render", "--trace", str(saved), "--latency", "5", "-o", str(out)]) == 2
    assert _err(capsys) == (
        f"error: render: --trace {saved} draws the saved run: its program comes from the file, so render would "
        f"ignore --latency 5; drop it (schedule and cost options are for render SCHEDULE)")
    assert main(["render", "--trace", str(saved), "-v", "2", "--split-backward", "--forward-only", "--ties", "0,1",
                 "--memory-limit", "2,1", "-o", str(out)]) == 2
    assert ("would ignore --virtual-stages 2, --split-backward, --forward-only, --ties 0,1, --memory-limit 2,1; "
            "drop them") in _err(capsys)
    assert not out.exists()
    assert main(["render", "--trace", str(saved), "--compare", "--title", "T", "--dpi", "50", "-o", str(out)]) == 0


def test_render_refuses_mode_without_compare_and_as_recorded_without_trace(tmp_path, capsys):
    saved = _saved(tmp_path)
    assert main(["render", "--trace", str(saved), "--mode", "overlay", "-o", str(tmp_path / "a.png")]) == 2
    assert _err(capsys) == ("error: render: --mode overlay lays out --compare, and it was not given: add --compare "
                            "(with --trace), or drop --mode")
    assert main(["render", "1f1b", "--as-recorded", "-o", str(tmp_path / "b.png")]) == 2
    assert _err(capsys) == ("error: render: --as-recorded keeps the compute events of a --trace file as they were "
                            "recorded; a simulated SCHEDULE has none: drop --as-recorded")
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "b.png").exists()
    assert main(["render", "--trace", str(saved), "--compare", "--mode", "overlay",
                 "-o", str(tmp_path / "c.png")]) == 0


@pytest.mark.parametrize("dpi, message", [
    ("100000", "argument --dpi: dots per inch must be from 20 to 600 (print quality is 300 to 600), got 100000"),
    ("0", "argument --dpi: dots per inch must be from 20 to 600 (print quality is 300 to 600), got 0"),
    ("19", "argument --dpi: dots per inch must be from 20 to 600 (print quality is 300 to 600), got 19"),
    ("x", "argument --dpi: expected an integer from 20 to 600, got 'x'"),
])
def test_render_dpi_out_of_range_is_a_usage_error(tmp_path, capsys, dpi, message):
    with pytest.raises(SystemExit) as exc:
        main(["render", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / "d.png"), "--dpi", dpi])
    assert exc.value.code == 2
    assert _err(capsys) == f"pipesched render: error: {message}"
    assert not (tmp_path / "d.png").exists()


def test_render_dpi_bounds_are_accepted(tmp_path):
    for dpi in ("20", "600"):
        assert main(["render", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / f"d{dpi}.png"), "--dpi", dpi]) == 0


def test_render_picture_too_big_for_memory_names_dpi(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    def no_memory(self, *args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(Figure, "savefig", no_memory)
    assert main(["render", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / "d.png"), "--dpi", "600"]) == 2
    line = _err(capsys)
    assert line.startswith("error: render: --dpi 600: the ") and line.endswith(
        "-pixel picture does not fit in memory; lower --dpi, or write .svg or .pdf")


def test_gallery_checks_measured_files_before_writing(tmp_path, capsys):
    from pipesched.viz.gallery import main as gallery

    out = tmp_path / "gal"
    good = _saved(tmp_path, "good.json")
    missing = tmp_path / "nonexist.json"
    assert gallery(["--out", str(out), "--no-cpu-run", "--measured", str(good), "--measured", str(missing)]) == 2
    assert _err(capsys) == f"error: gallery: --measured {missing}: cannot read it: No such file or directory"
    assert not out.exists()
    one = _saved(tmp_path, "one.json", ranks=(0,))
    assert gallery(["--out", str(out), "--no-cpu-run", "--measured", str(one)]) == 2
    assert _err(capsys) == (f"error: gallery: --measured {one}: the measured timeline holds ranks [0] of 2; a "
                            f"prediction needs every rank's costs: save Pipeline.gather_timeline(), not .timeline()")
    assert not out.exists()
    (out / "measured").mkdir(parents=True)  # the default: every <out>/measured/*.json, named without --measured
    (out / "measured" / "one.json").write_bytes(one.read_bytes())
    assert gallery(["--out", str(out), "--no-cpu-run"]) == 2
    assert _err(capsys).startswith(f"error: gallery: {out / 'measured' / 'one.json'}: the measured timeline holds")
    assert sorted(p.name for p in out.iterdir()) == ["measured"]
