"""``pipesched demo --plan`` refuses every option the plan decides (exit 2, naming it), also one given at its default
value (new-user trial D, item 3: ``--plan --schedule 1f1b`` trained with the plan's schedule instead); left out,
each still takes its default. Only parses the command line: no rank starts, no torch model is built."""
import pytest

from pipesched.demo.options import options

MESSAGE = (": --plan decides the schedule, microbatches, virtual stages, balance and recompute; leave these out, or "
           "drop --plan")


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        options(argv, prog="pipesched demo")
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("given, named", [
    (["--schedule", "1f1b"], "--schedule 1f1b"),              # the default value: was silently overridden
    (["--schedule=1f1b"], "--schedule 1f1b"),
    (["--microbatches", "4"], "--microbatches 4"),            # the default value: was silently overridden
    (["--micro", "4"], "--microbatches 4"),                   # argparse's abbreviation
    (["--balance", "params"], "--balance params"),            # the default value: was silently overridden
    (["--balance", "layers"], "--balance layers"),
    (["--virtual-stages", "1"], "--virtual-stages 1"),
    (["--recompute"], "--recompute True"),
    (["--schedule", "gpipe"], "--schedule gpipe"),            # another value: refused before as well
    (["--microbatches", "8"], "--microbatches 8"),
])
def test_plan_refuses_a_planned_option_even_at_its_default(given, named, capsys):
    for argv in (["--plan"] + given, given + ["--plan"]):
        assert f"pipesched demo: error: {named}{MESSAGE}\n" in _refused(argv, capsys)


def test_plan_names_every_planned_option_given(capsys):
    err = _refused(["--plan", "--schedule", "1f1b", "--microbatches", "4", "--balance", "params"], capsys)
    assert f"error: --schedule 1f1b, --microbatches 4, --balance params{MESSAGE}\n" in err


def test_plan_alone_takes_the_defaults_and_the_other_options():
    args = options(["--plan", "--ranks", "2", "--memory", "2GiB", "--steps", "3"])
    assert (args.plan, args.ranks, args.memory, args.steps) == (True, 2, 2 * 2**30, 3)
    assert (args.schedule, args.microbatches, args.balance, args.recompute, args.virtual_stages) == (
        "1f1b", 4, "params", False, 1)


@pytest.mark.parametrize("argv, expect", [
    ([], ("1f1b", 4, "params", False, 1)),
    (["--schedule", "1f1b", "--microbatches", "4", "--balance", "params"], ("1f1b", 4, "params", False, 1)),
    (["--schedule", "zb-h1", "--microbatches", "8", "--recompute"], ("zb-h1", 8, "params", True, 1)),
    (["--schedule", "interleaved-1f1b", "--balance", "layers"], ("interleaved-1f1b", 4, None, False, 2)),
    (["--balance", "2,2,2,1"], ("1f1b", 4, [2, 2, 2, 1], False, 1)),
])
def test_without_plan_the_options_and_their_defaults_are_as_before(argv, expect):
    args = options(argv)
    assert (args.schedule, args.microbatches, args.balance, args.recompute, args.virtual_stages) == expect


def test_checks_that_read_a_planned_option_see_its_default_when_left_out(capsys):
    # --batch is checked against --microbatches: left out, it is its default 4
    assert "error: --batch 3 must be >= --microbatches 4" in _refused(["--batch", "3"], capsys)
    assert "error: --batch 3 must be >= --microbatches 4" in _refused(["--batch", "3", "--microbatches", "4"], capsys)
