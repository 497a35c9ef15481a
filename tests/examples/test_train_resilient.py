"""Kill and resume: under ``torchrun --max-restarts 1``, rank 1 of examples/train_resilient.py SIGKILLs itself in the
middle of step 5 of the first attempt; torchrun restarts the job, which resumes from the latest complete checkpoint
(step 4) and finishes with the final loss, bitwise, of a run that was never killed."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipesched.runtime import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_resilient.py"
pytestmark = pytest.mark.multiprocess


def _reference(rank, argv):
    """The script's ``main`` in a launch child, never killed."""
    spec = importlib.util.spec_from_file_location("train_resilient", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _torchrun(tmp_path, *argv, timeout=300):
    # port 0: the agent binds its store to a port the OS picks (as --standalone does), never one "free a moment ago"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
               "--rdzv-id", "resilient", "--local-addr", "127.0.0.1", "--monitor-interval", "0.1", str(SCRIPT), *argv]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_rank_killed_mid_run_comes_back_and_finishes_with_the_unkilled_final_loss(tmp_path):
    run = _torchrun(tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "8", "--every", "2",
                    "--kill-at", "5", "--kill-rank", "1", "--result", str(tmp_path / "killed.json"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "exitcode: -9" in run.stderr, run.stderr[-3000:]  # the first attempt's rank 1 was SIGKILLed
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert (killed["attempt"], killed["resumed_from"]) == (1, 4), killed  # restarted once, from step-000004
    argv = ["--checkpoint-dir", str(tmp_path / "never"), "--steps", "8", "--every", "2"]
    reference = launch(_reference, 2, argv, timeout=240, start_method="fork")
    assert reference[0] == reference[1]
    assert killed["final_loss"] == reference[0].hex(), (killed, reference[0].hex())  # bitwise
    saved = [sorted(n for n in os.listdir(tmp_path / d) if not n.startswith(".")) for d in ("ckpt", "never")]
    assert saved[0] == saved[1] == ["step-000002", "step-000004", "step-000006", "step-000008"], saved


def test_each_restart_attempt_gets_its_own_key_space_on_the_agents_store(monkeypatch):
    """torchrun's agent keeps one store for every attempt: a key of attempt 0 (e.g. a dead rank's gloo address)
    must not be visible to attempt 1, else a restarted rank connects to the dead one's address."""
    import datetime

    import torch.distributed as dist

    from pipesched.runtime.elastic import attempt_store

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5))
    port = server.port
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_store(30.0)
    first.set("default_pg/0/cpu/rank_0", "127.0.0.1:1234")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_store(30.0)
    assert not second.check(["default_pg/0/cpu/rank_0"])
    assert server.check(["pipesched/attempt-0/default_pg/0/cpu/rank_0"])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store of the job's own: env:// as it is
    assert attempt_store(30.0) is None
