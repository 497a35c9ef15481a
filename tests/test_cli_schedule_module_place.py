"""``--schedule-module`` is accepted after ``validate`` and ``plan`` too, as after list/show/simulate/render, so
``pipesched validate --schedule-module M FILE`` no longer takes M for FILE and fails with "unrecognized arguments:
--schedule-module FILE" (new-user trial D, item 7)."""
import argparse
import sys
from pathlib import Path

import pytest

from pipesched.cli import main, make_parser
from pipesched.profile import LayerProfile
from pipesched.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
MODULE = str(ROOT / "examples" / "chunked_gpipe.py")
HANDWRITTEN = str(ROOT / "schedules" / "examples" / "handwritten-1f1b-p2-m3.txt")
VALID = f"valid: {HANDWRITTEN}: 2 ranks, 2 stages, 3 microbatches, 24 instructions;"


@pytest.fixture
def clean_registry():
    """Leaves REGISTRY (and the imported example module) as it found them."""
    before = set(REGISTRY.registered())
    yield
    for name in set(REGISTRY.registered()) - before:
        REGISTRY.unregister(name)
    sys.modules.pop("chunked_gpipe", None)


@pytest.fixture
def profile_file(tmp_path):
    layers, mib = 8, 2**20
    LayerProfile(forward=[1e-3] * layers, input_grad=[1e-3] * layers, weight_grad=[1e-3] * layers,
                 activation_bytes=[8 * mib] * layers, output_bytes=[mib] * layers, param_bytes=[4 * mib] * layers,
                 microbatch_size=1, latency=1e-5, bandwidth=1e9).save(tmp_path / "profile.json")
    return str(tmp_path / "profile.json")


def test_every_command_but_demo_takes_the_option_after_it():
    parser = make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    takes = {name for name, p in sub.choices.items() if "--schedule-module" in p._option_string_actions}
    assert takes == set(sub.choices) - {"demo"}  # demo hands its options to its own parser


@pytest.mark.parametrize("argv", [
    ["validate", "--schedule-module", MODULE, HANDWRITTEN],   # the trial's command line
    ["validate", HANDWRITTEN, "--schedule-module", MODULE],
    ["--schedule-module", MODULE, "validate", HANDWRITTEN],   # before the command, as before
])
def test_validate_takes_it_before_or_after_the_file(argv, capsys, clean_registry):
    assert main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith(VALID) and out.err == ""
    assert "chunked-gpipe" in REGISTRY.registered()  # the module was imported


def test_validate_names_a_bad_module_after_the_command(capsys):
    assert main(["validate", "--schedule-module", "no_such_module_xyz", HANDWRITTEN]) == 2
    assert capsys.readouterr().err == ("error: --schedule-module no_such_module_xyz: cannot import it: "
                                       "ModuleNotFoundError: No module named 'no_such_module_xyz'\n")


@pytest.mark.parametrize("before", [True, False])
def test_plan_searches_a_registered_schedule_named_after_the_command(before, profile_file, capsys, clean_registry):
    argv = ["plan", "--profile", profile_file, "--world-size", "4", "--memory", "1GiB", "--batch", "32", "--top", "2",
            "--schedules", "chunked-gpipe"]
    argv = ["--schedule-module", MODULE] + argv if before else argv[:1] + ["--schedule-module", MODULE] + argv[1:]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[1:3]] == ["chunked-gpipe", "chunked-gpipe"]
    assert lines[-1].startswith("winner: chunked-gpipe ")


def test_plan_without_the_module_names_the_option(profile_file, capsys):
    assert main(["plan", "--profile", profile_file, "--world-size", "4", "--memory", "1GiB", "--batch", "32",
                 "--schedules", "chunked-gpipe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --schedules: unknown schedule 'chunked-gpipe'")
    assert err.endswith("on the command line, --schedule-module MODULE)\n")
