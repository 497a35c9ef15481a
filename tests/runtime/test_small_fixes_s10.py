"""Small fixes of session 10 (helper-103).

- replica_init.copy_replica_zero: a buffer of a sub-byte/bit dtype (uint4, int2, bits8, ...) made construction with
  dp_size > 1 fail ("copy_kernel" not implemented for 'UInt4'): every tensor now travels as its raw bytes (same-size
  integer views, wire.as_bytes), ordinary dtypes bit for bit as before.
- agreement.connected: a make_groups failure published by one rank ends the others' wait at once, naming it.
"""
import pytest
import torch
from torch import nn

import pipesched.runtime.replica_init as replica_init
from pipesched.runtime.comm import Grid
from pipesched.runtime.wire import as_bytes


def _can_create(name):
    dtype = getattr(torch, name, None)
    try:
        return dtype is not None and torch.empty(4, dtype=dtype).view(torch.uint8).numel() > 0
    except Exception:  # noqa: BLE001 - a torch without such a dtype
        return False


SUB_BYTE = [n for n in ("uint4", "int2", "bits8") if _can_create(n)]


def _random_bytes(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def odd_stages(seed):
    """Stage 0: buffers of the sub-byte/bit dtypes (one transposed: non-contiguous, one 0-dim) next to a float32
    parameter holding a NaN with a payload and -0.0 (bit patterns a value copy could change); stage 1: a Linear."""
    module = nn.Module()
    for k, name in enumerate(SUB_BYTE):
        dtype = getattr(torch, name)
        module.register_buffer(f"{name}_flat", _random_bytes(seed * 10 + k, 6).view(dtype).view(2, 3))
        module.register_buffer(f"{name}_t", _random_bytes(seed * 10 + k + 5, 12).view(dtype).view(3, 4).t())
        module.register_buffer(f"{name}_scalar", _random_bytes(seed * 10 + k + 7, 1).view(dtype).view(()))
    bits = torch.tensor([0x7FC00123, 0x80000000, seed + 1], dtype=torch.int64).int().view(torch.float32)
    module.odd = nn.Parameter(bits.clone())
    return {0: module, 1: nn.Linear(2, 2)}


def _raw_rows(stages):
    return [(t.dtype, tuple(t.shape), as_bytes(t).tolist()) for t in replica_init.replica_tensors(stages)]


def _copy(monkeypatch, stages, dp_rank, sent):
    """copy_replica_zero on replica ``dp_rank`` of 2 (pipeline rank 1 of 2), all-gather and broadcasts faked: replica
    0 records what it broadcasts into ``sent``, replica 1 receives ``sent`` in order."""
    calls = []

    def gather(values, group, size, dtype, device, what):
        return [list(values), list(values)]

    def broadcast(tensor, src, group):
        assert (tensor.dtype, tensor.is_contiguous(), src, group) == (torch.uint8, True, 1, "dp")
        if dp_rank == 0:
            sent.append(tensor.clone())
        else:
            tensor.copy_(sent[len(calls)])
        calls.append(tensor.numel())

    monkeypatch.setattr(replica_init, "BUCKET_BYTES", 16)
    monkeypatch.setattr(replica_init, "gather_rows", gather)
    monkeypatch.setattr(replica_init.dist, "broadcast", broadcast)
    grid = Grid(world_rank=1 + 2 * dp_rank, world_size=4, pp_size=2, dp_size=2)
    replica_init.copy_replica_zero(stages, "dp", grid, torch.device("cpu"))
    return calls


@pytest.mark.skipif(not SUB_BYTE, reason="this torch cannot create uint4, int2 nor bits8 tensors")
def test_sub_byte_and_bit_buffers_travel_as_their_bytes(monkeypatch):
    zero, mine = odd_stages(0), odd_stages(1)
    want, before = _raw_rows(zero), _raw_rows(mine)
    assert want != before
    ids = [id(t) for t in replica_init.replica_tensors(mine)]
    sent = []
    sizes = _copy(monkeypatch, zero, 0, sent)
    assert _raw_rows(zero) == want  # replica 0 unchanged
    assert _copy(monkeypatch, mine, 1, sent) == sizes
    assert sum(sizes) == replica_init.layout(replica_init.replica_tensors(zero))[1] == 19 * len(SUB_BYTE) + 12 + 24
    assert [id(t) for t in replica_init.replica_tensors(mine)] == ids  # written in place
    assert _raw_rows(mine) == want
    assert not mine[0].get_buffer(f"{SUB_BYTE[0]}_t").is_contiguous()


def test_ordinary_dtypes_are_sent_as_before_bit_for_bit(monkeypatch):
    """What replica 0 broadcasts is what the value copy sent (torch.cat of the values, viewed as bytes)."""
    stages = {0: nn.Sequential(nn.Linear(3, 4)), 1: nn.Module()}
    stages[1].register_buffer("halves", torch.randn(2, 3).half().t())
    stages[1].register_buffer("nan", torch.tensor([0x7FC00123, 0x80000000]).int().view(torch.float32))
    stages[1].register_buffer("cplx", torch.randn(2, 3, dtype=torch.complex64).t())
    stages[1].register_buffer("flags", torch.tensor([True, False, True]))
    tensors = replica_init.replica_tensors(stages)
    before = [torch.cat([t.detach().reshape(-1) for t in b]).view(torch.uint8)
              for b in replica_init.buckets(tensors, 16)]
    sent = []
    _copy(monkeypatch, stages, 0, sent)
    assert len(sent) == len(before) == 6 and all(torch.equal(a, b) for a, b in zip(sent, before))
    other = {0: nn.Sequential(nn.Linear(3, 4)), 1: nn.Module()}
    for name, buf in stages[1].named_buffers():
        other[1].register_buffer(name, torch.zeros_like(buf))
    _copy(monkeypatch, other, 1, sent)
    assert _raw_rows(other) == _raw_rows(stages)


# ---- agreement.connected ends at once on a make_groups failure published by another rank -----------------------

import torch.distributed as dist  # noqa: E402

import pipesched.runtime.comm as comm  # noqa: E402
from pipesched.runtime import PipelineError  # noqa: E402
from pipesched.runtime.agreement import connected  # noqa: E402

GRID = {rank: Grid(world_rank=rank, world_size=2, pp_size=2, dp_size=1) for rank in (0, 1)}


def _make_groups(monkeypatch, store, rank, fail):
    """make_groups on ``rank`` of 2 over ``store``; its creation raises (``fail``) or returns fake groups (as NCCL's
    lazy dist.new_group returns at once, whatever a peer's creation did)."""
    def new_groups(grid, timeout, device):
        if fail:
            raise RuntimeError("ncclInternalError: rank 1 could not create its communicator")
        return "pp", None

    monkeypatch.setattr(comm.dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(comm, "_new_groups", new_groups)
    return comm.make_groups(GRID[rank], 30.0, torch.device("cpu"))


def test_connected_raises_at_once_the_failure_another_rank_published_in_make_groups(monkeypatch):
    store = dist.HashStore()
    assert _make_groups(monkeypatch, store, 0, fail=False) == ("pp", None)  # rank 0: created (lazily)
    with pytest.raises(PipelineError) as own:
        _make_groups(monkeypatch, store, 1, fail=True)  # rank 1: failed and published it
    with pytest.raises(PipelineError) as raised:
        connected(store, 0, 2, timeout=30.0)  # before: waited out the 30 s, then TimeoutError naming rank 1
    for exc in (own.value, raised.value):
        assert (exc.rank, exc.pp_rank) == (1, 1)
        assert exc.cause == "RuntimeError: ncclInternalError: rank 1 could not create its communicator"
        assert "while creating the Pipeline's process groups (dist.new_group, every rank of the job, timeout=30 s)" \
            in str(exc)
    assert raised.value.seen_by == 0 and "while waiting for every rank's entry in pipesched/connected/1" in \
        str(raised.value)


def test_connected_watches_its_own_attempt_and_returns_once_every_rank_connected(monkeypatch):
    store = dist.HashStore()
    for rank in (0, 1):  # attempt 1: rank 1 fails; both ranks are refused (rank 0 in connected)
        try:
            _make_groups(monkeypatch, store, rank, fail=rank == 1)
        except PipelineError:
            pass
    with pytest.raises(PipelineError):
        connected(store, 0, 2, timeout=30.0)
    for rank in (0, 1):  # attempt 2 succeeds on both: attempt 1's record ends nothing
        assert _make_groups(monkeypatch, store, rank, fail=False) == ("pp", None)
    assert comm.groups_error_key(store, 0) == comm.groups_error_key(store, 1) == "pipesched/groups/2/error"
    store.set("pipesched/connected/2/1", "true")  # rank 1's entry in the round rank 0 now reads (its second)
    assert connected(store, 0, 2, timeout=30.0) is None
