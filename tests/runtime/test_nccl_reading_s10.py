"""The collectives added in session 10 as NCCL would see them, checked on the CPU with fake groups (what each call
is given: its device, dtype, contiguity, source, and where the current CUDA device is), plus a few real NCCL cases
skipped without a GPU (one GPU is enough: each uses a 1-rank NCCL group; run
``python -m pytest tests/runtime/test_cuda.py tests/runtime/test_nccl_reading_s10.py``).

- replica_init: every replica's layout (count, bytes, dtypes and shapes) is all-gathered on the stages' device
  before the broadcasts and refused on every replica where it differs (gloo aborted with signal 6 on a broadcast
  of another size, or filled a larger buffer in part silently; NCCL hangs or corrupts); each broadcast is one
  contiguous uint8 tensor on the stages' device, from replica 0's world rank over the data-parallel group; copies
  back keep the tensors' identity and write replica 0's values into non-contiguous, bool, int16, bfloat16, float64
  and empty tensors.
- call_args / handshake: the meeting row carrying an argument is ROW_LEN int64 words on the pipeline's device;
  the replicas' agreement row (batch size last) is SIG_LEN words on it.
- profile_link: the arguments' all_gather_object runs with the given CUDA device current on NCCL (it puts its
  tensors on the current device), nothing changed on gloo or without a device.
- two GPUs (skipped with fewer): dp=2 over NCCL, replicas equal after construction, batch sizes agreed, profile_link
  with device= and no set_device.
- two replicas launched with one buffer in float64 on replica 1 (float32 on replica 0): refused at construction
  on both, naming the difference (before: rank 1 killed by signal 6, gloo's 'Received data size doesn't match').
"""
import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipesched.runtime.link_profile as link_profile
import pipesched.runtime.replica_init as replica_init
from pipesched.runtime import Pipeline, PipelineError, launch
from pipesched.runtime.call_args import meet_with_argument
from pipesched.runtime.comm import Grid
from pipesched.runtime.handshake import COLLECTIVE_MARK, ROW_LEN, Handshake
from pipesched.runtime.refusals import SIG_LEN, Rejected

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Mixed(nn.Module):
    """Parameters and buffers of the kinds a bucket must carry: a transposed (non-contiguous) weight, bool, int16,
    bfloat16, float64 and an empty buffer."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(3, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 3, generator=g))
        self.wt = nn.Parameter(torch.randn(3, 5, generator=g).t())  # non-contiguous
        self.register_buffer("mask", torch.rand(6, generator=g) > 0.5)
        self.register_buffer("counts", torch.randint(-300, 300, (2, 3), generator=g).to(torch.int16))
        self.register_buffer("brain", torch.randn(5, generator=g).to(torch.bfloat16))
        self.register_buffer("wide", torch.randn(2, generator=g, dtype=torch.float64), persistent=False)
        self.register_buffer("empty", torch.zeros(0))


def stages_of(seed, device):
    return {0: nn.Sequential(Mixed(seed)).to(device), 2: nn.Sequential(nn.Linear(2, 2)).to(device)}


def _flat_buckets(stages, limit):
    tensors = replica_init.replica_tensors(stages)
    return [torch.cat([t.detach().reshape(-1) for t in b]).view(torch.uint8).clone()
            for b in replica_init.buckets(tensors, limit)]


def _fake_copy(monkeypatch, device, dp_rank, layouts=None, limit=64):
    """copy_replica_zero on replica ``dp_rank`` (of 2) of pipeline rank 1 (pp 2), with the layout all-gather and the
    broadcasts faked: the broadcasts deliver replica 0's bytes (stages seeded 0); returns (stages, calls)."""
    monkeypatch.setattr(replica_init, "BUCKET_BYTES", limit)
    zero, mine = stages_of(0, device), stages_of(1 + dp_rank, device)
    if dp_rank == 0:
        mine = zero
    sent = _flat_buckets(zero, limit)
    calls = {"gather": [], "broadcast": []}

    def gather(values, group, size, dtype, dev, what):
        calls["gather"].append((list(values), group, size, dtype, torch.device(dev)))
        rows = layouts or [replica_init.layout(replica_init.replica_tensors(zero)), list(values)]
        return [list(r) for r in rows]

    def broadcast(tensor, src, group):
        calls["broadcast"].append((tensor.device, tensor.dtype, tensor.is_contiguous(), tensor.numel(), src, group))
        tensor.copy_(sent[len(calls["broadcast"]) - 1])  # in place: the receiver's buffer

    monkeypatch.setattr(replica_init, "gather_rows", gather)
    monkeypatch.setattr(replica_init.dist, "broadcast", broadcast)
    grid = Grid(world_rank=1 + 2 * dp_rank, world_size=4, pp_size=2, dp_size=2)
    before = {id(t): t for t in replica_init.replica_tensors(mine)}
    replica_init.copy_replica_zero(mine, "dp-group", grid, torch.device(device))
    assert {id(t) for t in replica_init.replica_tensors(mine)} == set(before)  # the same objects
    return zero, mine, calls


@pytest.mark.parametrize("device", DEVICES)
def test_replica_copy_sends_uint8_on_the_stages_device_and_writes_replica_zero_in_place(monkeypatch, device):
    zero, mine, calls = _fake_copy(monkeypatch, device, dp_rank=1)
    want = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    (values, group, size, dtype, at), = calls["gather"]
    assert (group, size, dtype, at.type) == ("dp-group", 2, torch.int64, want.type) and len(values) == 3
    sizes = [n for *_, n, _, _ in calls["broadcast"]]
    assert len(sizes) == 7 and sum(sizes) == values[1]  # 64-byte buckets: float32 cut in 3, 4 other dtypes
    for dev, dt, contiguous, _, src, grp in calls["broadcast"]:
        assert (dev, dt, contiguous, src, grp) == (want, torch.uint8, True, 1, "dp-group")
    for a, b in zip(replica_init.replica_tensors(zero), replica_init.replica_tensors(mine)):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    assert not mine[0][0].wt.is_contiguous()  # still the transposed view, now with replica 0's values


@pytest.mark.parametrize("device", DEVICES)
def test_replica_zero_broadcasts_and_keeps_its_values(monkeypatch, device):
    zero, mine, calls = _fake_copy(monkeypatch, device, dp_rank=0)
    assert len(calls["broadcast"]) == 7 and {c[4] for c in calls["broadcast"]} == {1}
    assert torch.equal(mine[0][0].counts, stages_of(0, device)[0][0].counts)


def test_layouts_differing_between_replicas_are_refused_before_any_broadcast(monkeypatch):
    mine = replica_init.layout(replica_init.replica_tensors(stages_of(0, "cpu")))
    other = list(mine[:2]) + [mine[2] + 1]  # same count and bytes, another dtype or shape
    with pytest.raises(ValueError) as info:
        _fake_copy(monkeypatch, "cpu", dp_rank=0, layouts=[mine, other])
    assert str(info.value) == (
        f"pipeline rank 1's stage parameters and buffers differ between replicas: replica 0 has {mine[0]} tensors of "
        f"{mine[1]} bytes, replica 1 {mine[0]} tensors of {mine[1]} bytes (other dtypes or shapes); build the same "
        f"model, with the same dtypes and buffers, on every rank before constructing the Pipeline")


def test_layout_follows_dtypes_and_shapes_not_values():
    a, b = stages_of(0, "cpu"), stages_of(5, "cpu")
    assert replica_init.layout(replica_init.replica_tensors(a)) == replica_init.layout(replica_init.replica_tensors(b))
    b[0][0].wide = b[0][0].wide.float()  # a non-persistent buffer in float32 on this replica only
    la, lb = (replica_init.layout(replica_init.replica_tensors(s)) for s in (a, b))
    assert la[0] == lb[0] and lb[1] == la[1] - 8 and la[2] != lb[2]


class FakeGroup:
    """An all-gather that records this rank's row and returns it for every rank (``others`` changes theirs)."""

    def __init__(self, size, others=None):
        self.size, self.others, self.seen = size, others, []

    def allgather(self, outputs, inputs):
        (rows,), (mine,) = outputs, inputs
        self.seen.append((mine.device, mine.dtype, tuple(mine.shape), mine.is_contiguous()))
        for k, row in enumerate(rows):
            row.copy_(mine if self.others is None or k == 0 else self.others(k, mine))
        return types.SimpleNamespace(wait=lambda: None)


@pytest.mark.parametrize("device", DEVICES)
def test_meeting_row_with_an_argument_is_one_int64_row_on_the_pipelines_device(device):
    group = FakeGroup(2)
    meet_with_argument(group, 2, device, COLLECTIVE_MARK, "the collective", "run_collective", "work", len, None,
                       compare=False)
    (dev, dtype, shape, contiguous), = group.seen
    assert (dev.type, dtype, shape, contiguous) == (device, torch.int64, (ROW_LEN,), True)
    refusing = FakeGroup(2)
    with pytest.raises(Rejected) as info:  # every rank refused alike: its own error
        meet_with_argument(refusing, 2, device, COLLECTIVE_MARK, "the collective", "run_collective", "work", 3,
                           TypeError("work must be a callable"), compare=False)
    assert info.value.kind is TypeError and refusing.seen[0][2] == (ROW_LEN,)


@pytest.mark.parametrize("device", DEVICES)
def test_replicas_agreement_row_carries_the_batch_size_on_the_device(device):
    def replica_one(k, mine):
        row = mine.clone()
        row[-1] = 3
        return row

    group = FakeGroup(2, replica_one)
    shake = Handshake.__new__(Handshake)
    shake.dp_group, shake.program, shake.device = group, types.SimpleNamespace(dp_size=2), torch.device(device)
    shake._agree_replicas(True, None, 0, 5)  # the caller's autocast word 0 (off), as on the other replica
    (dev, dtype, shape, _), = group.seen
    assert (dev.type, dtype, shape) == (device, torch.int64, (SIG_LEN,))
    assert shake.replica_batches == [5, 3]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("backend, device, current", [
    ("nccl", "cuda:1", 1), ("nccl", torch.device("cuda", 3), 3), ("nccl", None, 0), ("nccl", "cuda", None),
    ("nccl", "not a device", None), ("gloo", "cuda:1", None), ("gloo", "cpu", None)])
def test_profile_link_gathers_its_arguments_with_the_given_cuda_device_current(monkeypatch, backend, device,
                                                                              current):
    state = {"current": None, "gathered": None}

    @contextlib.contextmanager
    def cuda_device(dev):
        before, state["current"] = state["current"], torch.device(dev).index
        try:
            yield
        finally:
            state["current"] = before

    def gather(rows, mine, group=None):
        state["gathered"] = (state["current"], mine)
        raise _Stop

    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2,
                                 get_backend=lambda group=None: backend, get_rank=lambda: 0,
                                 all_gather_object=gather, ProcessGroup=link_profile.dist.ProcessGroup)
    monkeypatch.setattr(link_profile, "dist", fake)
    monkeypatch.setattr(torch.cuda, "device", cuda_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(_Stop):
        link_profile.profile_link(device=device)
    assert state["gathered"][0] == current and state["current"] is None
    assert ("error" in state["gathered"][1]) is (device == "not a device")


# ---- two replicas, one with a float64 buffer where the other has float32 (CPU, gloo) ----------------------------

def other_dtype(rank):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].register_buffer("scale", torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32))
    try:
        Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, dp_size=2, timeout=60)
    except PipelineError as exc:
        return str(exc)
    return "constructed"


def test_replicas_with_a_buffer_of_another_dtype_are_refused_on_both():
    for text in launch(other_dtype, 2, timeout=120):
        assert "stage parameters and buffers differ between replicas: replica 0 has 5 tensors of 176 bytes, " \
               "replica 1 5 tensors of 192 bytes" in text, text


# ---- real NCCL, one GPU: 1-rank NCCL groups ---------------------------------------------------------------------

def nccl_one_rank(rank):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    group = dist.new_group([0], backend="nccl")
    stages = stages_of(0, device)
    expect = [t.clone() for t in replica_init.replica_tensors(stages)]
    replica_init.BUCKET_BYTES = 64
    # dp_rank 1 of a 1-rank group whose source is this rank: the copy-back path runs over NCCL on the device
    replica_init.copy_replica_zero(stages, group, Grid(world_rank=1, world_size=1, pp_size=1, dp_size=1), device)
    copied = all(a.dtype == b.dtype and torch.equal(a, b)
                 for a, b in zip(expect, replica_init.replica_tensors(stages)))
    meet_with_argument(group, 1, device, COLLECTIVE_MARK, "the collective", "run_collective", "work", len, None,
                       compare=False)
    try:
        meet_with_argument(group, 1, device, COLLECTIVE_MARK, "the collective", "run_collective", "work", 3,
                           TypeError("work must be a callable"), compare=False)
        refused = None
    except Rejected as exc:
        refused = exc.kind.__name__
    shake = Handshake.__new__(Handshake)
    shake.dp_group, shake.program, shake.device = group, types.SimpleNamespace(dp_size=1), device
    shake.autocast = None
    shake._agree_replicas(True, None, 7)
    with link_profile._object_device("cuda:0", group):
        current = torch.cuda.current_device()
    return {"copied": copied, "refused": refused, "batches": shake.replica_batches, "current": current}


@needs_cuda
def test_nccl_one_rank_replica_copy_meeting_rows_and_agreement_on_the_gpu():
    result = launch(nccl_one_rank, 1, timeout=300)[0]
    assert result == {"copied": True, "refused": "TypeError", "batches": [7], "current": 0}, result


# ---- real NCCL, two GPUs: two replicas (dp=2, pp=1) -------------------------------------------------------------

class MixedNet(Mixed):
    def forward(self, x):  # (rows, 3) -> (rows, 4), every parameter used
        return x @ self.lin.weight.t() + self.lin.bias + (x @ self.wt.t()).sum(dim=1, keepdim=True) * 0


def nccl_two_replicas(rank):
    import torch.distributed as dist

    device = torch.device("cuda", rank)  # no set_device: the Pipeline makes it current; profile_link gets device=
    group = dist.new_group([0, 1], backend="nccl")  # launch's default group is gloo
    link = link_profile.profile_link(group, nbytes=(1 << 10, 1 << 16), repeat=2, device=device)
    torch.manual_seed(rank)  # replicas built with other initial weights: replica 0's are copied at construction
    model = nn.Sequential(MixedNet(rank), nn.Linear(4, 4)).to(device)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=1, loss_fn=F.mse_loss, dp_size=2)
    values = [t.detach().cpu() for t in replica_init.replica_tensors(pipe.stages)]
    rows = 5 if rank == 0 else 3  # replicas of different batch sizes: both sizes ride in the agreement row
    pipe.step(torch.ones(rows, 3, device=device), target=torch.zeros(rows, 4, device=device))
    out = {"values": values, "batches": pipe._handshake.replica_batches, "link_ok": link.send_overhead >= 0}
    pipe.close()
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_two_replicas_start_equal_and_agree_on_batch_sizes():
    first, second = launch(nccl_two_replicas, 2, timeout=300)
    assert first["batches"] == second["batches"] == [5, 3]
    assert first["link_ok"] and second["link_ok"]
    for a, b in zip(first["values"], second["values"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
