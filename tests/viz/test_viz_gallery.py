"""The gallery command writes every expected picture, a trace and a README that shows them."""
from pathlib import Path

import pytest

from pipesched import SCHEDULES
from pipesched.viz.gallery import build_gallery, main, render_measured_comparison

from viz_support import measured_like

PNG = b"\x89PNG\r\n\x1a\n"


def test_gallery_writes_every_schedule_chart_and_comparison(tmp_path):
    run = tmp_path / "run-1f1b.json"
    measured_like().save(run)
    written = build_gallery(tmp_path / "viz", measured=[run])
    names = {Path(p).name for p in written}
    for name, info in SCHEDULES.items():
        v = info.default_virtual_stages
        assert f"timeline-{name}-p4-m8" + (f"-v{v}" if v > 1 else "") + ".png" in names
    for name in ("timeline-1f1b-p8-m32.png", "bubble-vs-microbatches-p4.png", "bubble-vs-microbatches-p8.png",
                 "timeline-1f1b-p4-m8-dp2-recompute-latency.png", "trace-1f1b-p4-m8.json",
                 "sim-vs-measured-run-1f1b.png", "README.md"):
        assert name in names
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == PNG
    readme = (tmp_path / "viz" / "README.md").read_text()
    assert "(timeline-1f1b-p8-m32.png)" in readme and "(sim-vs-measured-run-1f1b.png)" in readme


def test_measured_comparison_hook(tmp_path):
    run = tmp_path / "cpu.json"
    measured_like().save(run)
    assert render_measured_comparison(run, tmp_path) == tmp_path / "sim-vs-measured-cpu.png"
    assert (tmp_path / "sim-vs-measured-cpu.png").read_bytes()[:8] == PNG


def test_gallery_main_picks_up_measured_folder(tmp_path, capsys):
    (tmp_path / "measured").mkdir()
    measured_like().save(tmp_path / "measured" / "gloo.json")
    assert main(["--out", str(tmp_path), "--no-cpu-run"]) == 0
    assert "sim-vs-measured-gloo.png" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_cpu_run_measures_every_instruction_of_the_reference_program():
    pytest.importorskip("torch")
    from pipesched import compile_program
    from pipesched.viz.cpu_run import measure_cpu_run

    timeline = measure_cpu_run("1f1b", 2, 4, steps=2, width=64, batch=16)
    program = compile_program("1f1b", 2, 4)
    assert timeline.source == "measured" and timeline.num_ranks == 2
    assert sorted(str(e.instr) for e in timeline.events) == sorted(str(i) for s in program.ranks for i in s)
    assert timeline.meta["schedule"] == "1f1b" and timeline.meta["microbatches"] == 4
    assert 0 < timeline.bubble_fraction < 1
