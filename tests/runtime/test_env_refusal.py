"""Under a launcher's environment (torchrun's MASTER_ADDR / RANK / WORLD_SIZE, no process group made before
``Pipeline``), a construction error on one rank reaches the others: the refusing rank joins the default group's
rendezvous to file its refusal, so a rank with valid arguments raises it instead of waiting out its timeout."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

RANK_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from pipesched.runtime import Pipeline
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    m = 0 if sys.argv[1] == "refuse" else 2  # rank 1's own mistake: the others' arguments are valid
    if sys.argv[1] == "late":  # reaches the agreement 3 s after the rendezvous (slow to get there, as under load)
        import time
        import pipesched.runtime.pipeline as pipeline
        agree = pipeline.agree
        pipeline.agree = lambda *args, **kwargs: (time.sleep(3), agree(*args, **kwargs))[1]
    try:
        Pipeline(model, schedule="1f1b", num_microbatches=m, loss_fn=F.mse_loss, timeout=float(sys.argv[2]))
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
    else:
        print("CONSTRUCTED", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(roles: list[str], timeout_s: float, tmp_path) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = _free_port()
    procs = []
    for rank, role in enumerate(roles):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(len(roles)), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), role, str(timeout_s)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    # the guard is far past the refusal's path (seconds) but under the ranks' own timeout: a rank that waits
    # its timeout instead of reading the refusal is killed here and shows no RAISED line
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=timeout_s - 30)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outs.append("KILLED " + proc.communicate()[0])
    return [next((line for line in out.splitlines() if line.startswith(("RAISED", "CONSTRUCTED"))), out)
            for out in outs]


REFUSED = "RAISED ScheduleArgumentError: num_microbatches must be an integer >= 1, got 0"


# world rank 0 hosts the store: it waits for the others' entries before its exit takes the store away (without
# that wait the late rank met a store that no longer answered)
@pytest.mark.parametrize("refusing, other", [(1, "valid"), (0, "valid"), (0, "late")])
def test_the_refusing_rank_joins_the_rendezvous_and_the_others_raise_its_error(tmp_path, refusing, other):
    outs = _run(["refuse" if rank == refusing else other for rank in range(2)], 120, tmp_path)
    assert outs[refusing] == REFUSED
    assert outs[1 - refusing] == (f"RAISED ValueError: world rank {refusing} refused its Pipeline arguments: "
                                  f"{REFUSED.removeprefix('RAISED ')}")  # before: a TimeoutError after 120 s


def test_every_rank_refusing_still_raises_each_ranks_own_error(tmp_path):
    assert _run(["refuse", "refuse"], 120, tmp_path) == [REFUSED, REFUSED]
