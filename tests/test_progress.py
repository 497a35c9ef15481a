"""Progress of long CLI work (pipesched/progress.py): on stderr, and only when stderr is a terminal."""
import io
import json
import os
import pty
import subprocess
import sys

import pytest

from pipesched import progress
from pipesched.cli import long_work, main, make_parser


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def at_once(monkeypatch):
    monkeypatch.setattr(progress, "AFTER_SECONDS", 0.0)  # every note shown, however quick the work


def test_nothing_on_stderr_that_is_not_a_terminal(at_once, capsys):
    assert main(["simulate", "zb-auto", "-p", "3", "-m", "6"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("zb-auto: p=3 m=6")


def test_on_a_terminal_the_phases_show_and_the_line_is_erased(at_once, capsys, monkeypatch):
    plain = (main(["simulate", "zb-auto", "-p", "3", "-m", "6"]), capsys.readouterr().out)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert (main(["simulate", "zb-auto", "-p", "3", "-m", "6"]), capsys.readouterr().out) == plain  # stdout as is
    shown = terminal.getvalue()
    assert shown.startswith("\r\x1b[K[0 s] ") and shown.endswith("\r\x1b[K") and "\n" not in shown
    assert [note[len("[0 s] "):] for note in shown.split("\r\x1b[K") if note] == [
        "building zb-auto",
        *(f"zb-auto: greedy candidate {k} of at most 20" for k in range(1, 13)),  # 8 warmups coincide at p=3
        *(f"zb-auto: scoring candidate {k} of 21" for k in (1, 2, 5, 6)),  # 4 distinct programs of 21
        "lowering zb-auto: 54 instructions", "validating zb-auto: 102 instructions",
        "simulating: timing 102 instructions", "simulating: the timeline of 102 instructions",
        "summarizing the timeline"]


def test_json_stdout_stays_one_object_with_a_terminal_stderr(at_once, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(["simulate", "1f1b", "-p", "2", "-m", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == 12.0  # (m + p - 1)(F + B)
    assert "simulating: timing" in sys.stderr.getvalue()


def test_quick_work_stays_silent_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(progress, "AFTER_SECONDS", 3600.0)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(["show", "1f1b", "-p", "2", "-m", "2"]) == 0
    assert sys.stderr.getvalue() == ""


def test_commands_other_than_show_simulate_render_show_none(at_once, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stderr", Terminal())
    path = tmp_path / "p.txt"
    main(["show", "1f1b", "-p", "2", "-m", "2", "--format", "text"])
    path.write_text(capsys.readouterr().out)
    sys.stderr.truncate(0)
    assert main(["validate", str(path)]) == 0
    assert sys.stderr.getvalue() == ""


def test_notes_outside_a_terminal_block_go_nowhere(capsys):
    progress.note("nobody listens")
    progress.clear()
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("argv, expected", [
    (["simulate", "1f1b", "-p", "4", "-m", "1000000"], True),
    (["simulate", "1f1b", "-p", "4", "-m", "1000"], False),
    (["show", "zb-auto", "-p", "64", "-m", "512"], True),
    (["render", "interleaved-1f1b", "-p", "8", "-m", "64", "-v", "2", "-o", "x.png"], False),
])
def test_long_work_is_known_from_the_sizes(argv, expected):
    assert long_work(make_parser().parse_known_args(argv)[0]) is expected


def test_a_real_pseudo_terminal(tmp_path):
    code = ("import pipesched.progress as p; p.AFTER_SECONDS = 0; from pipesched.cli import main; "
            "raise SystemExit(main(['simulate', '1f1b', '-p', '2', '-m', '2']))")
    master, slave = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=slave, timeout=120)
    finally:
        os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the other end closed (Linux: EIO)
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert proc.returncode == 0 and proc.stdout.startswith(b"1f1b: p=2 m=2")
    assert b"simulating: timing" in shown and shown.endswith(b"\r\x1b[K")
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == b"" and piped.stdout == proc.stdout


def test_nothing_on_stderr_redirected_while_stdout_is_a_terminal(at_once, monkeypatch):
    """``pipesched simulate ... 2> log`` on a terminal: the log gets no progress lines."""
    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert main(["simulate", "1f1b", "-p", "2", "-m", "3"]) == 0
    assert sys.stderr.getvalue() == "" and sys.stdout.getvalue().startswith("1f1b: p=2 m=3")
