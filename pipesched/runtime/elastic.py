"""A store of its own for each attempt of a job that ``torchrun --max-restarts N`` restarts.

Under torchrun's c10d rendezvous the workers share the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``),
and the agent keeps that one server for every restart (torch 2.13), while torch's ``env://`` rendezvous adds no
prefix per attempt. A restarted attempt then finds the previous attempt's keys: gloo can read a dead rank's
listening address (``Gloo connectFullMesh failed ... Connection refused``), and pipesched's failure records, votes
and agreement would be read stale. :func:`attempt_store` gives each attempt its own key space
(keys under ``pipesched/attempt-<TORCHELASTIC_RESTART_COUNT>/``) on the agent's server.
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def attempt_store(timeout: float):
    """The default group's store for this attempt under torchrun's agent store, else ``None`` (use ``env://``).

    Args:
        timeout: seconds to wait for the agent's store (and, in it, for keys).
    Returns:
        A ``PrefixStore("pipesched/attempt-<n>", TCPStore client of MASTER_ADDR:MASTER_PORT)``, ``n`` the
        ``TORCHELASTIC_RESTART_COUNT``; ``None`` when ``TORCHELASTIC_USE_AGENT_STORE`` is not ``True``.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"pipesched/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
