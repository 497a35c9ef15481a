"""``pipesched validate FILE --backend {gloo,nccl}``: what a Pipeline on that backend refuses before any communication,
refused by the command line with the Pipeline's own error, through the same functions."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pipesched as ps
from pipesched import user_programs
from pipesched.cli import main
from pipesched.errors import DeadlockError, PairingError, ScheduleError

EXAMPLES = Path(__file__).resolve().parents[1] / "schedules" / "examples"
GOOD = EXAMPLES / "handwritten-1f1b-p2-m3.txt"

#: gpipe p=2 m=3 with receives posted 2 instructions early: the gloo steps run it, but on nccl rank 0 posts the
#: receive of microbatch 0's gradient where rank 1 posts the receive of microbatch 2's activation
NCCL_ORDER = ("rank 0, RECV_B0.0<1: ranks 0 and 1 post their messages to each other in different orders: here rank 0 "
              "posts the recv of the gradient of stage 1's input, microbatch 0, where rank 1 posts the recv of stage "
              "0's output, microbatch 2; a backend that runs a pair's messages in issue order on one stream (NCCL) "
              "would hang. On backend 'nccl' both ranks of a pair post their messages to each other in one order")
#: 1f1b p=2 m=4 with receives posted 16 instructions early: valid, but its shape-learning step hangs (both backends)
LEARNING = ("rank 0, B0.0: while learning the message shapes (each RECV_F waits for its SEND_F's header; the grid is "
            "the learning view, each such F moved up to its RECV_F): deadlock: no rank can make progress and work "
            "remains\n  rank 0 blocked at B0.0 (step 8): waiting for SEND_B1.0>0 on rank 1\n  rank 1 blocked at F1.2 "
            "(step 5): waiting for SEND_F0.2>1 on rank 0\n")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def nccl_only(tmp_path):
    path = tmp_path / "gpipe-early2.txt"
    path.write_text(ps.to_text(ps.compile_program("gpipe", 2, 3, early_receives=2)))
    return path


@pytest.fixture
def learning_hangs(tmp_path):
    path = tmp_path / "1f1b-early16.json"  # the JSON form: --backend reads either
    path.write_text(ps.to_json(ps.compile_program("1f1b", 2, 4, early_receives=16)))
    return path


def test_plainly_valid_but_refused_on_nccl(capsys, nccl_only):
    code, out, _ = run(capsys, "validate", nccl_only)
    assert code == 0 and out.startswith(f"valid: {nccl_only}: 2 ranks") and "Pipeline" not in out
    code, out, _ = run(capsys, "validate", nccl_only, "--backend", "gloo")
    assert code == 0 and "; a Pipeline on gloo runs it (its step protocol proven" in out
    code, out, err = run(capsys, "validate", nccl_only, "--backend", "nccl")
    assert (code, out) == (1, "")
    assert err.startswith(f"invalid on backend nccl: {nccl_only}: PairingError: {NCCL_ORDER}")
    assert "<-- here" in err


def test_nccl_refusal_as_json(capsys, nccl_only):
    code, out, err = run(capsys, "validate", nccl_only, "--backend", "nccl", "--json")
    data = json.loads(out)
    assert code == 1 and err == ""
    assert {k: data[k] for k in ("valid", "cause", "error", "rank", "instruction", "backend")} == {
        "valid": False, "cause": "PairingError", "error": "PairingError", "rank": 0, "instruction": "RECV_B0.0<1",
        "backend": "nccl"}
    assert NCCL_ORDER.startswith("rank 0, RECV_B0.0<1: " + data["reason"][:200])


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_learning_step_that_hangs_is_refused(capsys, learning_hangs, backend):
    assert run(capsys, "validate", learning_hangs)[0] == 0
    code, out, err = run(capsys, "validate", learning_hangs, "--backend", backend)
    assert code == 1
    if backend == "gloo":  # gloo's steady step is fine (tag matching): the learning step is what hangs
        assert err.startswith(f"invalid on backend gloo: {learning_hangs}: ScheduleError: {LEARNING}")
        assert (". The program is valid, but a step that learns the message shapes (a Pipeline's first step, and the "
                "first after a change of input signature or settings) waits for each activation's shape header") in err
        assert "Post each RECV_F right before the F that uses it, or issue each SEND_F before its rank's next" in err
    else:  # nccl refuses the pair order first
        assert err.startswith(f"invalid on backend nccl: {learning_hangs}: PairingError: rank 0, RECV_B0.0<1: ranks "
                              f"0 and 1 post their messages to each other in different orders")
    code, out, _ = run(capsys, "validate", learning_hangs, "--backend", backend, "--json")
    data = json.loads(out)
    expected = {"gloo": ("deadlock", "ScheduleError", 0, "B0.0"), "nccl": ("PairingError", "PairingError", 0,
                                                                           "RECV_B0.0<1")}[backend]
    assert (code, data["valid"], data["backend"]) == (1, False, backend)
    assert (data["cause"], data["error"], data["rank"], data["instruction"]) == expected


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_good_program_is_accepted_on_both(capsys, backend):
    code, out, err = run(capsys, "validate", GOOD, "--backend", backend)
    assert (code, err) == (0, "")
    assert f"send/recv-paired and deadlock-free; a Pipeline on {backend} runs it" in out
    code, out, _ = run(capsys, "validate", GOOD, "--backend", backend, "--json")
    data = json.loads(out)
    assert (code, data["valid"], data["backend"], data["ranks"], data["num_microbatches"]) == (0, True, backend, 2, 3)


def test_without_backend_the_json_is_unchanged(capsys):
    code, out, _ = run(capsys, "validate", GOOD, "--json")
    assert code == 0 and "backend" not in json.loads(out)


@pytest.mark.parametrize("program, message", [
    (ps.compile_program("1f1b", 2, 2, forward_only=True),
     "the program is forward-only (forward_only=True); a Pipeline needs the training program and derives the "
     "forward-only one itself"),
    (ps.build("1f1b", 2, 2),
     "the program is compute-only (no SEND/RECV); lower it first: pipesched.add_send_recv(program), or register "
     "its builder (pipesched.register_schedule)"),
])
def test_programs_a_pipeline_does_not_take(capsys, tmp_path, program, message):
    path = tmp_path / "p.txt"
    path.write_text(ps.to_text(program))
    assert run(capsys, "validate", path)[0] == 0
    code, _, err = run(capsys, "validate", path, "--backend", "nccl")
    assert (code, err) == (1, f"invalid on backend nccl: {path}: ValueError: {message}\n")
    code, out, _ = run(capsys, "validate", path, "--backend", "gloo", "--json")
    assert code == 1 and json.loads(out) == {"valid": False, "cause": "ValueError", "error": "ValueError",
                                             "rank": None, "instruction": None, "reason": message, "backend": "gloo"}


def test_stages_all_on_one_rank_need_no_lowering(capsys, tmp_path):
    # rank 1 idle, no edge between ranks: add_send_recv returns it unchanged, so "lower it first" looped (a hunt)
    m = 2
    work = [ps.Instr(ps.Op.F, s, mb) for mb in range(m) for s in range(2)]
    work += [ps.Instr(ps.Op.B, s, mb) for mb in range(m) for s in (1, 0)]
    program = ps.Program((tuple(work), ()), (0, 0), m)
    assert ps.add_send_recv(program) == program
    path = tmp_path / "p.txt"
    path.write_text(ps.to_text(program))
    code, out, _ = run(capsys, "validate", path, "--backend", "gloo")
    assert code == 0 and "complete, ordered, send/recv-paired and deadlock-free" in out
    assert "a Pipeline on gloo runs it" in out


def test_an_invalid_program_is_reported_as_before(capsys):
    code, _, err = run(capsys, "validate", EXAMPLES / "broken-deadlock.txt", "--backend", "nccl")
    assert code == 1 and err.startswith(f"invalid: {EXAMPLES / 'broken-deadlock.txt'}: DeadlockError: ")


def test_unknown_backend_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(GOOD), "--backend", "mpi"])
    assert exc.value.code == 2 and "argument --backend: invalid choice: 'mpi'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, got 'mpi'"):
        user_programs.backend_programs(ps.load(GOOD), "mpi")


def test_backend_check_stays_torch_free(nccl_only):
    code = ("import sys; from pipesched.cli import main; "
            f"assert main(['validate', {str(nccl_only)!r}, '--backend', 'nccl']) == 1; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# --- the Pipeline gives the same error, from the same function ----------------------------------------------------

def test_cli_and_pipeline_call_the_same_functions():
    construction = pytest.importorskip("pipesched.runtime.construction")
    assert construction.step_programs is user_programs.step_programs  # the proof of the step programs
    assert construction.program_for is user_programs.program_for  # whose check_user_program -> check_pipeline_program


def _pipeline_error(monkeypatch, path: Path, backend: str) -> ScheduleError:
    """The error ``Pipeline(model, schedule=program)`` raises on pipeline rank 0 of 2 on ``backend``, before any
    communication (as under torchrun: WORLD_SIZE set, no process group yet); nccl's choice of backend patched in,
    the stages staying on the CPU."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from pipesched.runtime import Pipeline, construction

    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert not dist.is_initialized()
    monkeypatch.setattr(construction, "backend_for", lambda device: backend)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ScheduleError) as caught:
        Pipeline(model, schedule=ps.load(path), num_microbatches=ps.load(path).num_microbatches,
                 loss_fn=torch.nn.functional.mse_loss)
    assert not dist.is_initialized()  # refused before any communication
    return caught.value


@pytest.mark.parametrize("backend, kind", [("nccl", PairingError), ("gloo", ScheduleError)])
def test_pipeline_refuses_with_the_text_the_cli_prints(capsys, monkeypatch, nccl_only, learning_hangs, backend, kind):
    path = nccl_only if backend == "nccl" else learning_hangs
    error = _pipeline_error(monkeypatch, path, backend)
    assert type(error) is kind
    assert isinstance(error.__cause__, DeadlockError) == (backend == "gloo")
    code, _, err = run(capsys, "validate", path, "--backend", backend)
    assert (code, err) == (1, f"invalid on backend {backend}: {path}: {kind.__name__}: {error}\n")
    assert str(error).startswith(NCCL_ORDER if backend == "nccl" else LEARNING)
