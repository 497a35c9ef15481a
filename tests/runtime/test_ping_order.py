"""The order in which zb-auto's latency ping (``measured_costs._initiate`` / ``_serve``) posts its receives and
sends: on gloo every receive ahead of the round trips (so a send call times only this rank's own work), on NCCL each
receive after the send before it (NCCL runs a pair's messages in issue order on one stream: a receive posted ahead of
a send to the same peer holds that send up, and the ping would wait for ever on both ranks). Fake transports record
the calls; no process group, no GPU (the CUDA case runs with a fake device and a fake ``torch`` in the module)."""
from types import SimpleNamespace

import pytest
import torch

from pipesched.runtime import measured_costs

ROUNDS = measured_costs._REPEATS + 1
PING, PONG, HEADER = measured_costs._TAG_PING, measured_costs._TAG_PONG, measured_costs._TAG_HEADER


class _Done:
    def wait(self):
        return True


class FakeTransport:
    """Records ("post" | "send" | "wait", tag); every receive has its message already."""

    def __init__(self, device_type: str, header: int = 8):
        self.device = SimpleNamespace(type=device_type)
        self.calls, self.header = [], header

    def send(self, tensors, peer, tag):
        self.calls.append(("send", tag))
        return _Done(), None

    def post(self, specs, peer, tag, what):
        self.calls.append(("post", tag))
        return tag

    def wait(self, tag):
        self.calls.append(("wait", tag))
        value = torch.tensor([self.header]) if tag == HEADER else torch.zeros(self.header, dtype=torch.uint8)
        return (value,), None


@pytest.fixture
def fake_torch(monkeypatch):
    """``measured_costs``'s torch with tensors made on the CPU whatever the device, and no CUDA synchronisation."""
    fake = SimpleNamespace(int64=torch.int64, uint8=torch.uint8,
                           tensor=lambda data, dtype, device: torch.tensor(data, dtype=dtype),
                           zeros=lambda n, dtype, device: torch.zeros(n, dtype=dtype),
                           cuda=SimpleNamespace(synchronize=lambda device: None))
    monkeypatch.setattr(measured_costs, "torch", fake)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_initiator_order(fake_torch, device_type):
    transport = FakeTransport(device_type)
    measured_costs._initiate(transport, 1, 8, [])
    if device_type == "cpu":  # gloo: every pong posted before the first ping
        rounds = [("post", PONG)] * ROUNDS + [("send", PING), ("wait", PONG)] * ROUNDS
    else:  # NCCL: no receive ahead of a send to the same peer
        rounds = [("send", PING), ("post", PONG), ("wait", PONG)] * ROUNDS
    assert transport.calls == [("send", HEADER)] + rounds


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_server_order(fake_torch, device_type):
    transport = FakeTransport(device_type)
    calls = []
    measured_costs._serve(transport, 0, calls)
    head = [("post", HEADER), ("wait", HEADER)]
    if device_type == "cpu":
        rounds = [("post", PING)] * ROUNDS + [("wait", PING), ("send", PONG)] * ROUNDS
    else:
        rounds = [("post", PING), ("wait", PING), ("send", PONG)] * ROUNDS
    assert transport.calls == head + rounds
    assert len(calls) == ROUNDS - 1  # the first (warm-up) pong's send call is not counted
