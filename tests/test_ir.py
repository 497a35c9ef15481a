"""Instructions: the text form round-trips and bad instructions are refused with a clear message."""
import pytest

from pipesched import Instr, Op


@pytest.mark.parametrize("text, expected", [
    ("F0.3", Instr(Op.F, 0, 3)),
    ("B12.40", Instr(Op.B, 12, 40)),
    ("SEND_F0.3>1", Instr(Op.SEND_F, 0, 3, 1)),
    ("RECV_B2.0<3", Instr(Op.RECV_B, 2, 0, 3)),
    ("ALL_REDUCE1", Instr(Op.ALL_REDUCE, 1)),
    ("W5.0", Instr(Op.W, 5, 0)),
    ("R1.2", Instr(Op.R, 1, 2)),
])
def test_parse_and_format_round_trip(text, expected):
    assert Instr.parse(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize("text", ["X0.1", "F", "F0.1>2", "SEND_F0.1<2", "F-1.0", "SEND_F0.1", "ALL_REDUCE0.1"])
def test_bad_text_is_refused(text):
    with pytest.raises(ValueError):
        Instr.parse(text)


def test_comm_instruction_needs_a_peer():
    with pytest.raises(ValueError, match="peer"):
        Instr(Op.SEND_F, 0, 0)


def test_instructions_are_hashable_and_ordered():
    a, b = Instr(Op.F, 0, 0), Instr(Op.F, 0, 1)
    assert len({a, b, Instr.parse("F0.0")}) == 2
    assert a.key == (Op.F, 0, 0)


def test_trusted_constructor_makes_the_same_value():
    made = Instr.trusted(Op.SEND_F, 0, 3, 1)
    assert made == Instr(Op.SEND_F, 0, 3, 1) and type(made) is Instr
    assert hash(made) == hash(Instr.parse("SEND_F0.3>1")) and str(made) == "SEND_F0.3>1"


@pytest.mark.parametrize("args, message", [
    ((Op.F, -1, 0), "stage must be >= 0"),
    ((Op.F, 0), "needs a microbatch"),
    ((Op.ALL_REDUCE, 0, 1), "ALL_REDUCE takes no microbatch"),
    ((Op.F, 0, 0, 1), "peer must be given exactly"),
])
def test_checked_constructor_refuses_bad_fields(args, message):
    with pytest.raises(ValueError, match=message):
        Instr(*args)


def test_instructions_are_immutable_values():
    import pickle

    a = Instr("B", 2, 1)  # the kind may be given by name
    assert a.op is Op.B and sorted([a, Instr(Op.B, 1, 5), Instr(Op.B, 2, 0)])[0] == Instr(Op.B, 1, 5)
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == "Instr(op=<Op.B: 'B'>, stage=2, microbatch=1, peer=None)"
    with pytest.raises(AttributeError):
        a.stage = 3


def test_replace_checks_the_new_fields():
    assert Instr(Op.F, 1, 2)._replace(stage=3) == Instr(Op.F, 3, 2)
    with pytest.raises(ValueError, match="stage must be >= 0"):
        Instr(Op.F, 1, 2)._replace(stage=-1)


def test_an_unknown_kind_or_a_non_string_text_names_what_is_valid():
    # Instr("Q", 0, 0) raised the enum's own "'Q' is not a valid Op"; Instr.parse(5) an AttributeError (an audit)
    with pytest.raises(ValueError) as info:
        Instr("Q", 0, 0)
    assert str(info.value) == ("op must be one of F, B, I, W, R, SEND_F, RECV_F, SEND_B, RECV_B, ALL_REDUCE, "
                               "TIE_REDUCE (an Op or its name), got 'Q'")
    assert Instr("F", 0, 1) == Instr(Op.F, 0, 1)
    with pytest.raises(TypeError, match=r"^Instr.parse: text must be a str such as 'F0.3', got int 5$"):
        Instr.parse(5)
