"""argparse's usage errors (an unknown option, a bad int, a missing argument, an unknown command) under ``--json``:
exit 2 as before, argparse's text on stderr as before, and on stdout one JSON object ``{"error", "exit_status"}``
as the commands' other errors print; without ``--json`` stdout stays empty. Torch-free."""
import json
import sys

import pytest

from pipesched.cli import asks_json, main


def run(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.mark.parametrize("argv, message, prog", [
    (("show", "1f1b", "-p", "x", "-m", "4", "--json"), "argument --ranks/-p: invalid int value: 'x'",
     "pipesched show"),
    (("simulate", "--json", "1f1b", "-p", "2", "-m", "four"),
     "argument --microbatches/-m: invalid int value: 'four'", "pipesched simulate"),
    # the command's own usage and name (the top level's printed "usage: pipesched [-h] ... COMMAND ...")
    (("simulate", "1f1b", "-p", "2", "-m", "4", "--json", "--bogus"), "unrecognized arguments: --bogus",
     "pipesched simulate"),
    (("list", "--json", "--bogus", "x"), "unrecognized arguments: --bogus x", "pipesched list"),
    (("show", "--json"), "the following arguments are required: SCHEDULE", "pipesched show"),
    (("show", "1f1b", "-p", "2", "-m", "4", "--format", "svg", "--json"),
     "argument --format: invalid choice: 'svg' (choose from 'grid', 'text')", "pipesched show"),
    (("plan", "--json", "--profile", "p.json", "--world-size", "two", "--memory", "1GiB", "--batch", "4"),
     "argument --world-size: invalid int value: 'two'", "pipesched plan"),
    (("frob", "--json"), "argument COMMAND: invalid choice: 'frob'", "pipesched"),
    (("show", "1f1b", "-p", "x", "-m", "4", "--js"), "argument --ranks/-p: invalid int value: 'x'",
     "pipesched show"),  # an abbreviation argparse takes for --json
])
def test_usage_errors_under_json_are_json_on_stdout(capsys, argv, message, prog):
    code, out, err = run(capsys, *argv)
    assert code == 2
    data = json.loads(out)  # one JSON object, nothing else on stdout
    assert set(data) == {"error", "exit_status"} and data["exit_status"] == 2
    assert data["error"].startswith(message)
    assert f"{prog}: error: {message}" in err and err.startswith(f"usage: {prog} ")  # argparse's text
    plain = [a for a in argv if a not in ("--json", "--js")]
    code, out, err = run(capsys, *plain)
    assert code == 2 and out == "" and f"{prog}: error: {message}" in err  # without --json: as argparse prints


def test_json_after_a_double_dash_is_no_option(capsys):
    code, out, err = run(capsys, "show", "1f1b", "-p", "x", "-m", "4", "--", "--json")
    assert code == 2 and out == "" and "pipesched show: error: argument --ranks/-p: invalid int value: 'x'" in err


def test_the_command_line_is_read_from_sys_argv_too(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pipesched", "simulate", "1f1b", "-p", "0x", "-m", "4", "--json"])
    with pytest.raises(SystemExit) as info:
        main()
    out, _ = capsys.readouterr()
    assert info.value.code == 2
    assert json.loads(out) == {"error": "argument --ranks/-p: invalid int value: '0x'", "exit_status": 2}


def test_help_and_success_are_unchanged(capsys):
    with pytest.raises(SystemExit) as info:
        main(["list", "--help", "--json"])
    out, _ = capsys.readouterr()
    assert info.value.code == 0 and out.startswith("usage: pipesched list")
    assert main(["list", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)


@pytest.mark.parametrize("argv, asked", [
    (["show", "--json"], True), (["--json=1"], True), (["--jso"], True), (["--j"], True),
    (["show", "-j"], False), (["--"], False), (["--", "--json"], False), (["--jsonx"], False), ([], False),
    (["--memory", "--json"], True),
])
def test_asks_json(argv, asked):
    assert asks_json(argv) is asked
