"""``pipesched demo`` checks --lr, --timeout and --balance counts on the command line, before any rank starts, naming
the option (new-user trial F, bug5: they failed inside every spawned rank 30+ s later, as "Invalid learning rate:
-1.0"); --corpus-bytes takes the 2e6 its help shows, and --ranks' help shows its default (bug7). Only parses the
command line: no rank starts, no torch model is built."""
import pytest

from pipesched.demo.options import MAX_TIMEOUT_S, options


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        options(argv, prog="pipesched demo")
    assert info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0 and at most 1e+09, got 0.0"),
    (["--timeout", "-5"], "--timeout must be a number of seconds > 0 and at most 1e+09, got -5.0"),
    (["--timeout", "inf"], "--timeout must be a number of seconds > 0 and at most 1e+09, got inf"),
    (["--timeout", "2e9"], "--timeout must be a number of seconds > 0 and at most 1e+09, got 2000000000.0"),
    (["--balance", "0,3,2,2"], "--balance 0,3,2,2: every stage needs at least one layer (counts >= 1), got 0 for "
                               "stage 0"),
    (["--balance", "3,3,-1,2"], "--balance 3,3,-1,2: every stage needs at least one layer (counts >= 1), got -1 "
                                "for stage 2"),
    (["--corpus-bytes", "2.5e6x"], "argument --corpus-bytes: a whole number of bytes is needed, e.g. 2000000 or "
                                   "2e6, got '2.5e6x'"),
    (["--corpus-bytes", "1.5"], "argument --corpus-bytes: a whole number of bytes is needed, e.g. 2000000 or 2e6, "
                                "got '1.5'"),
])
def test_refused_before_any_rank_starts_naming_the_option(argv, message, capsys):
    assert _refused(argv, capsys) == f"pipesched demo: error: {message}"


def test_the_largest_timeout_is_the_pipelines():
    pytest.importorskip("torch")
    from pipesched.runtime.construction import MAX_TIMEOUT_S as pipeline_max

    assert MAX_TIMEOUT_S == pipeline_max
    assert options(["--timeout", "1e9"]).timeout == 1e9


def test_good_values_pass():
    assert options(["--lr", "0"]).lr == 0.0  # torch's AdamW takes 0 (it trains nothing): so does the demo
    args = options(["--lr", "1e-4", "--timeout", "0.5", "--balance", "1,2,2,2"])
    assert (args.lr, args.timeout, args.balance) == (1e-4, 0.5, [1, 2, 2, 2])


@pytest.mark.parametrize("text, value", [("2e6", 2_000_000), ("2000000", 2_000_000), ("5e5", 500_000),
                                         ("1.5e5", 150_000)])
def test_corpus_bytes_takes_the_notation_its_help_shows(text, value):
    assert options(["--corpus-bytes", text]).corpus_bytes == value


def test_corpus_bytes_default_is_an_int():
    assert options([]).corpus_bytes == 2_000_000 and type(options([]).corpus_bytes) is int


def test_help_shows_the_defaults_of_ranks_and_corpus_bytes(capsys):
    with pytest.raises(SystemExit):
        options(["--help"], prog="pipesched demo")
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "world size / dp; default 4)" in help_text
    assert "bytes of text to use, e.g. 500000 or 5e5 (default 2e6)" in help_text
