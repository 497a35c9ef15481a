"""`render` subcommand via its own argparse entry, and the import-cost guarantee of pipesched.viz."""
import json
import subprocess
import sys

import pytest

from pipesched.viz.cli import main
from pipesched.viz.compare import predict_for

from viz_support import measured_like

PNG = b"\x89PNG\r\n\x1a\n"


def test_render_schedule_to_png_and_svg(tmp_path, capsys):
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    assert main(["render", "1f1b", "--ranks", "4", "--microbatches", "8", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG
    assert "bubble fraction 0.2727" in capsys.readouterr().out
    assert main(["render", "interleaved-1f1b", "-p", "4", "-m", "8", "-v", "2", "--dp", "2", "--recompute",
                 "--forward", "1,1,2,1,1,1,2,1", "--latency", "0.1", "-o", str(svg)]) == 0
    assert b"<svg" in svg.read_bytes()[:400]


def test_render_honours_split_backward(tmp_path, capsys):
    out = tmp_path / "t.png"
    for extra, bubble in (((), "0.2941"), (("--split-backward",), "0.2000")):  # as `simulate`: 17 s vs 15 s
        assert main(["render", "1f1b", "-p", "2", "-m", "4", "--latency", "0.5", "-o", str(out), *extra]) == 0
        assert f"bubble fraction {bubble}" in capsys.readouterr().out


def test_render_schedule_to_chrome_trace(tmp_path):
    out = tmp_path / "t.json"
    assert main(["render", "gpipe", "-p", "2", "-m", "3", "-o", str(out)]) == 0
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    # per rank: 3 F + 3 B + 3 SEND + 3 RECV = 12
    assert len(events) == 24 and {e["pid"] for e in events} == {0, 1}


def test_render_measured_trace_and_comparison(tmp_path, capsys):
    saved = tmp_path / "run.json"
    measured_like().save(saved)
    assert main(["render", "--trace", str(saved), "-o", str(tmp_path / "m.png")]) == 0
    assert "measured timeline, bubble fraction 0.6250" in capsys.readouterr().out
    assert main(["render", "--trace", str(saved), "--compare", "--mode", "overlay",
                 "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG
    predicted = predict_for(measured_like()).bubble_fraction
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'c.png'}: measured vs simulated timeline, bubble fraction "
                                       f"0.6250 measured, {predicted:.4f} simulated\n")


@pytest.mark.parametrize("argv,message", [
    (["render", "nope", "-o", "x.png"], "unknown schedule 'nope'"),
    (["render", "1f1b", "-o", "x.txt"], "use .png, .svg, .pdf or .json"),
    (["render", "-o", "x.png"], "exactly one of them"),
    (["render", "1f1b", "--trace", "a.json", "-o", "x.png"], "exactly one of them"),
    (["render", "1f1b", "--compare", "-o", "x.png"], "--compare needs --trace"),
    (["render", "--trace", "missing.json", "-o", "x.png"], "missing.json"),
    (["render", "1f1b", "-p", "0", "-o", "x.png"], "ranks"),
])
def test_render_errors_exit_2_with_a_message(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_render_rejects_a_file_that_is_not_a_timeline(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{\"events\": []}")
    assert main(["render", "--trace", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert "not a saved Timeline" in capsys.readouterr().err


def test_importing_viz_and_its_cli_does_not_import_matplotlib():
    code = ("import pipesched, pipesched.viz, pipesched.viz.cli, pipesched.viz.trace, pipesched.viz.analysis, sys; "
            "bad = [m for m in ('matplotlib', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_render_trace_starts_compute_when_its_input_landed_unless_as_recorded(tmp_path, capsys):
    from pipesched import Event, Instr, Timeline

    rows = [(0, "F0.0", 0, 1), (0, "SEND_F0.0>1", 1, 1), (1, "RECV_F1.0<0", 0, 3), (1, "F1.0", 0.5, 4),
            (1, "B1.0", 4, 6), (1, "SEND_B1.0>0", 6, 6), (0, "RECV_B0.0<1", 1, 6.5), (0, "B0.0", 1, 8)]
    saved = tmp_path / "raw.json"
    Timeline(tuple(Event(r, Instr.parse(t), s, e) for r, t, s, e in rows), 2, source="measured").save(saved)
    assert main(["render", "--trace", str(saved), "-o", str(tmp_path / "a.png")]) == 0
    out = capsys.readouterr()
    assert "2 compute events" in out.err and "bubble fraction 0.6562" in out.out  # 10.5 / 16
    assert main(["render", "--trace", str(saved), "--as-recorded", "-o", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "bubble fraction 0.1562" in out.out  # (0 + 2.5) / 16 as recorded


def test_render_creates_the_output_folder_and_takes_every_memory_option(tmp_path, capsys):
    out = tmp_path / "some" / "missing" / "dir" / "x.png"
    assert main(["render", "1f1b", "-p", "2", "-m", "4", "--recompute", "--stash-bytes", "100", "--input-bytes",
                 "10", "--recompute-bytes", "110", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and f"wrote {out}" in capsys.readouterr().out
    trace = tmp_path / "other" / "t.json"
    assert main(["render", "gpipe", "-p", "2", "-m", "2", "-o", str(trace)]) == 0 and trace.stat().st_size > 0


def test_render_output_and_trace_errors_name_the_option(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["render", "1f1b", "-o", str(tmp_path / "afile" / "x.png")]) == 2
    assert f"error: render: -o {tmp_path / 'afile' / 'x.png'}: cannot create its folder" in capsys.readouterr().err
    assert main(["render", "--trace", str(tmp_path / "none.json"), "-o", str(tmp_path / "y.png")]) == 2
    assert f"--trace {tmp_path / 'none.json'}: cannot read it: No such file or directory" in capsys.readouterr().err
