"""given_options (pipesched/cli_costs.py): the options a command would ignore, named as typed, one rule for render's
schedule and cost options and show's cost options."""
import argparse

from pipesched.cli import add_schedule_args
from pipesched.cli_costs import add_cost_args, given_costs, given_options


def _schedule_args(parser):
    add_schedule_args(parser, optional_name=True)


def _parsed(argv):
    parser = argparse.ArgumentParser()
    _schedule_args(parser)
    add_cost_args(parser)
    return parser.parse_args(argv)


def test_flags_numbers_lists_and_groups_are_named_as_typed_in_the_parsers_order():
    args = _parsed(["1f1b", "-p", "6", "--recompute", "--ties", "0,3", "1,2", "--forward", "1,2.5,1,1"])
    assert given_options(args, _schedule_args, skip=("schedule", "schedule_modules")) == [
        "--ranks 6", "--recompute", "--ties 0,3 1,2"]
    assert given_costs(args) == ["--forward 1,2.5,1,1"]


def test_options_at_their_defaults_and_skipped_dests_are_left_out():
    args = _parsed(["gpipe", "--bandwidth", "inf", "--latency", "0"])
    assert given_options(args, _schedule_args, skip=("schedule", "schedule_modules")) == []
    assert given_costs(args) == []
    assert given_options(args, _schedule_args, skip=("schedule_modules",)) == []  # positional: never an option
    assert given_costs(_parsed(["gpipe", "--bandwidth", "1e6"])) == ["--bandwidth 1e+06"]
