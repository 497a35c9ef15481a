"""torch schedule CSV files <-> programs (pipesched/interop.py), without torch: hand-written files in torch 2.13's
format, our own round trip, the errors that name the line, and the CLI's --torch-csv options.
(tests/test_interop_torch.py checks the same against torch's own reader, writer and checkers.)"""
import warnings

import pytest

import pipesched as ps
from pipesched.cli import main
from pipesched.interop import OVERLAP_META, TORCH_META, TorchCsvWarning, from_torch_csv, to_torch_csv, torch_rows
from pipesched.ir import Instr, Op
from pipesched.torch_action import TorchAction, parse_action

#: 1F1B on 2 ranks, 2 microbatches, as torch 2.13's lowering writes it (UNSHARD/RESHARD/REDUCE_GRAD included)
ONE_F_ONE_B = (
    "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD,0RESHARD\r\n"
    "1UNSHARD,1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD,1RESHARD\r\n"
)


def write(tmp_path, text, name="s.csv"):
    path = tmp_path / name
    path.write_text(text, newline="")
    return path


def read(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        return from_torch_csv(path, **kwargs)


def test_parse_action_reads_every_kind_and_the_overlap_group():
    assert parse_action("3SEND_B12") == TorchAction("SEND_B", 3, 12)
    assert parse_action("1UNSHARD") == TorchAction("UNSHARD", 1)
    assert parse_action(" ") is None
    group = parse_action("(0F5;5B2)OVERLAP_F_B")
    assert group.subs == (TorchAction("F", 0, 5), TorchAction("B", 5, 2)) and str(group) == "(0F5;5B2)OVERLAP_F_B"
    for bad, says in (("2F0x", "cannot read torch action '2F0x'"), ("0F", "F needs a microbatch"),
                      ("0REDUCE_GRAD1", "REDUCE_GRAD takes no microbatch"),
                      ("(0F1;0SEND_F1)OVERLAP_F_B", "holds compute actions"), ("(0F1)FOO", "the only group kind")):
        with pytest.raises(ValueError, match=says):
            parse_action(bad)


def test_compute_comms_file_maps_stages_microbatches_kinds_and_peers(tmp_path):
    with pytest.warns(TorchCsvWarning) as caught:
        program = from_torch_csv(write(tmp_path, ONE_F_ONE_B))
    said = sorted(str(w.message).split(": ", 1)[1] for w in caught)
    assert said[0].startswith("dropped 2 REDUCE_GRAD: with dp_size=1 there are no replicas"), said
    assert said[1].startswith("dropped 2 UNSHARD, 2 RESHARD: FSDP-only"), said
    expected = ps.compile_program("1f1b", 2, 2)
    assert program.stage_to_rank == (0, 1) and program.num_microbatches == 2 and program.dp_size == 1
    assert program.ranks == expected.ranks  # torch's lowering of 1F1B here is ours, instruction for instruction
    assert program.meta[TORCH_META]["form"] == "compute_comms"
    assert program.meta[TORCH_META]["dropped"] == {"UNSHARD": 2, "RESHARD": 2, "REDUCE_GRAD": 2}
    ps.validate(program)


def test_reduce_grad_becomes_all_reduce_with_dp(tmp_path):
    program = read(write(tmp_path, ONE_F_ONE_B), dp_size=2)
    assert program.dp_size == 2
    assert program.ranks[0][-1] == Instr(Op.ALL_REDUCE, 0) and program.ranks[1][-1] == Instr(Op.ALL_REDUCE, 1)
    assert program.ranks == ps.compile_program("1f1b", 2, 2, dp_size=2).ranks
    ps.validate(program)


def test_compute_only_file_with_idle_cells_and_an_overlap_pair(tmp_path):
    path = write(tmp_path, "0F0,0F1,,0I0,0W0,(0F2;0B1)OVERLAP_F_B,0B2\r\n,1F0,1B0,1F1,1B1,1F2,1B2\r\n")
    program = from_torch_csv(path, schedule="mine")
    assert program.meta[TORCH_META]["form"] == "compute_only" and program.schedule == "mine"
    assert [str(i) for i in program.ranks[0]] == ["F0.0", "F0.1", "I0.0", "W0.0", "F0.2", "B0.1", "B0.2"]
    assert program.meta[OVERLAP_META] == ((Instr(Op.F, 0, 2), Instr(Op.B, 0, 1)),)
    ps.validate(ps.add_send_recv(program))
    assert torch_rows(program) == [["0F0", "0F1", "0I0", "0W0", "(0F2;0B1)OVERLAP_F_B", "0B2"],
                                   ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]]


def test_a_receive_out_of_the_senders_order_is_a_pairing_error_naming_both_messages(tmp_path):
    # rank 0 sends the activation of microbatch 1 before the gradient of microbatch 0 (V placement: stages 0, 3 on
    # rank 0); rank 1 posts the gradient's receive first, so in-order matching swaps the two same-shape messages
    path = write(tmp_path, "0F0,0SEND_F0,0F1,0SEND_F1,3RECV_F0,3F0,3B0,3SEND_B0,3RECV_F1,3F1,3B1,3SEND_B1,"
                           "0RECV_B0,0B0,0RECV_B1,0B1\r\n"
                           "1RECV_F0,1F0,2F0,2SEND_F0,2RECV_B0,1RECV_F1,2B0,1B0,1SEND_B0,1F1,2F1,2SEND_F1,2RECV_B1,"
                           "2B1,1B1,1SEND_B1\r\n")
    program = from_torch_csv(path)
    assert program.stage_to_rank == (0, 1, 1, 0)
    with pytest.raises(ps.PairingError) as info:
        ps.validate(program)
    assert (info.value.rank, str(info.value.instr)) == (0, "SEND_F0.1>1")
    assert "rank 0 sends SEND_F0.1>1 here, but rank 1's matching receive is RECV_B2.0<0" in info.value.reason


@pytest.mark.parametrize("text, kwargs, says", [
    ("0F0,0Q1\r\n", {}, r"s.csv, line 1, column 2 \(rank 0\): cannot read torch action '0Q1'"),
    ("0F0,0B0\r\n1F0,0F1\r\n", {}, r"line 2, column 2 \(rank 1, 0F1\): stage 0 has actions on rank 0 \(line 1\) "
                                   r"and on rank 1"),
    ("0F0,0SEND_F0,0B0\r\n", {}, r"line 1, column 2 \(rank 0, 0SEND_F0\): SEND_F of stage 0 has no stage 1 to send"),
    ("0F0,0B0\r\n2F0,2B0\r\n", {}, r"stage 1 has no action, so its rank is unknown .*; pass stage_to_rank"),
    ("0F0,0B0\r\n1F0,1B0\r\n", {"stage_to_rank": (0, 0)}, r"line 2, column 1 \(rank 1, 1F0\): stage_to_rank gives "
                                                          r"stage 1 rank 0, but this action of it is on rank 1"),
    ("", {}, "no actions"),
])
def test_bad_files_name_the_line_column_and_action(tmp_path, text, kwargs, says):
    with pytest.raises(ps.ProgramFormatError, match=says):
        from_torch_csv(write(tmp_path, text), **kwargs)


def test_sizes_from_the_arguments(tmp_path):
    path = write(tmp_path, "0F0,0B0\r\n")
    program = from_torch_csv(path, num_ranks=2, stage_to_rank=(0, 0), num_microbatches=2)
    assert program.num_ranks == 2 and program.ranks[1] == () and program.num_microbatches == 2
    with pytest.raises(ValueError, match="num_ranks=1, but .* has 2 rows"):
        from_torch_csv(write(tmp_path, "0F0\r\n1F0\r\n"), num_ranks=1)
    with pytest.raises(ValueError, match="dp_size must be an integer >= 1, got 0"):
        from_torch_csv(path, dp_size=0)


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("gpipe", 2, 3, 1), ("interleaved-1f1b", 4, 6, 2)])
@pytest.mark.parametrize("dp", [1, 3])
@pytest.mark.parametrize("split", [False, True])
def test_our_programs_round_trip_in_both_forms(tmp_path, name, p, m, v, dp, split):
    program = ps.compile_program(name, p, m, v, dp_size=dp, split_backward=split)
    to_torch_csv(program, tmp_path / "comms.csv")
    assert read(tmp_path / "comms.csv", dp_size=dp, schedule=name) == program
    to_torch_csv(program, tmp_path / "compute.csv", comms=False)
    back = read(tmp_path / "compute.csv", schedule=name)
    assert back.ranks == tuple(tuple(i for i in st if i.op in (Op.F, Op.B, Op.I, Op.W)) for st in program.ranks)
    assert back.meta[TORCH_META]["form"] == "compute_only"


def test_reduce_grad_is_written_where_torchs_lowering_puts_it(tmp_path):
    rows = torch_rows(ps.compile_program("1f1b", 2, 2))
    assert rows == [["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1", "0REDUCE_GRAD"],
                    ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1", "1REDUCE_GRAD"]]


def test_what_torch_cannot_express(tmp_path):
    with pytest.warns(TorchCsvWarning, match="dropped 4 R .recompute. instructions"):
        to_torch_csv(ps.compile_program("1f1b", 2, 2, recompute=True), tmp_path / "r.csv")
    assert read(tmp_path / "r.csv").ranks == ps.compile_program("1f1b", 2, 2).ranks  # the same, without the R
    with pytest.raises(ValueError, match="TIE_REDUCE"):
        to_torch_csv(ps.compile_program("1f1b", 2, 2, ties=((0, 1),)), tmp_path / "t.csv")
    with pytest.raises(ValueError, match="comms=True, but the program has no SEND/RECV"):
        to_torch_csv(ps.build("1f1b", 2, 2), tmp_path / "c.csv", comms=True)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_show_writes_and_validate_reads_torch_csv(tmp_path, capsys):
    code, out, _ = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--torch-csv", tmp_path / "o.csv")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'o.csv'}: 1f1b, 2 ranks")
    assert (tmp_path / "o.csv").read_text().splitlines()[0].split(",")[:3] == ["0F0", "0SEND_F0", "0F1"]
    code, out, _ = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--compute-only",
                       "--torch-csv", tmp_path / "c.csv")
    assert code == 0 and (tmp_path / "c.csv").read_bytes() == b"0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n"
    code, out, err = run(capsys, "validate", "--torch-csv", write(tmp_path, ONE_F_ONE_B, "t.csv"))
    assert code == 0 and out.startswith(f"valid: {tmp_path / 't.csv'}: 2 ranks")
    assert "note: " in err and "dropped 2 UNSHARD, 2 RESHARD" in err


def test_cli_validate_torch_csv_errors(tmp_path, capsys):
    bad = write(tmp_path, "0F0,0SEND_F0\r\n1RECV_F0,1F0,1B0\r\n", "bad.csv")  # stage 0 has no backward
    code, _, err = run(capsys, "validate", "--torch-csv", bad)
    assert code == 1 and "InvalidProgramError" in err and "B0.0" in err
    code, _, err = run(capsys, "validate")
    assert code == 2 and "FILE (pipesched's text or JSON form) or --torch-csv FILE, exactly one; got neither" in err
    code, _, err = run(capsys, "validate", "--torch-csv", write(tmp_path, "0Z0\r\n", "z.csv"))
    assert code == 1 and "ProgramFormatError" in err
    assert "line 1, column 1 (rank 0): cannot read torch action '0Z0'" in err


def test_cli_show_torch_csv_to_a_path_it_cannot_write_names_the_option(tmp_path, capsys):
    code, _, err = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--torch-csv", tmp_path / "no" / "x.csv")
    assert code == 2 and f"error: --torch-csv {tmp_path / 'no' / 'x.csv'}: cannot write it (No such file" in err
    code, _, err = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--torch-csv", tmp_path)
    assert code == 2 and f"error: --torch-csv {tmp_path}: cannot write it (Is a directory)" in err


def test_a_program_on_one_rank_is_written_with_its_reduce_grad_by_default(tmp_path):
    # torch scales the gradients by 1/m only at REDUCE_GRAD: a one-rank file without it, loaded as compute_comms,
    # trains with m times the gradients. The API's default now writes what the CLI writes
    for program in (ps.compile_program("1f1b", 1, 3), ps.compile_program("interleaved-1f1b", 1, 2, 2)):
        rows = torch_rows(program)
        assert len(rows) == 1 and rows[0][-1] == "0REDUCE_GRAD"
    assert torch_rows(ps.compile_program("1f1b", 1, 3)) == [["0F0", "0B0", "0F1", "0B1", "0F2", "0B2",
                                                              "0REDUCE_GRAD"]]
    assert torch_rows(ps.compile_program("1f1b", 1, 3), comms=False) == [["0F0", "0B0", "0F1", "0B1", "0F2", "0B2"]]
    # several ranks, compute-only (built, not lowered): still the compute_only form
    assert "SEND" not in " ".join(torch_rows(ps.build("1f1b", 2, 2))[0])


def test_a_forward_only_program_is_refused_not_written_unloadable(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^to_torch_csv: the program is forward-only; torch's schedule files"):
        to_torch_csv(ps.compile_program("1f1b", 2, 2, forward_only=True), tmp_path / "f.csv")
    assert not (tmp_path / "f.csv").exists()
    code = main(["show", "1f1b", "-p", "2", "-m", "2", "--forward-only", "--torch-csv", str(tmp_path / "g.csv")])
    assert code == 2 and "the program is forward-only" in capsys.readouterr().err
