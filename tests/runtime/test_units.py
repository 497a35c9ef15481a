"""Single-process pieces: microbatch splitting, stage balance, wire metas and packing, argument checks."""
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipesched.errors import ScheduleArgumentError, UnknownScheduleError
from pipesched.runtime import Pipeline, stage_activation_bytes
from pipesched.runtime.comm import make_grid
from pipesched.runtime.wire import decode_meta, empty_for, encode_meta, meta_of, pack, unpack
from pipesched.runtime.microbatch import merge, split, split_sizes
from pipesched.runtime.stage import min_max_partition, resolve_balance

from memory_store import MemoryStore
from rt_cases import mlp


def test_split_sizes_uneven_larger_first():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(4, 4) == [1, 1, 1, 1]


def test_batch_smaller_than_microbatches_is_a_value_error():
    with pytest.raises(ValueError, match="batch size 3 is smaller than num_microbatches=4"):
        split(torch.zeros(3, 2), 4)


def test_merge_explains_a_0_dim_output():
    with pytest.raises(ValueError, match=r"element 1 of the last stage's output is 0-dim \(shape \(\)\) on microbatch 0; "
                                         r"forward\(\) concatenates each tensor of it along dim 0 \(the batch dimension\)"):
        merge([(torch.ones(2), torch.tensor(1.0)), (torch.ones(2), torch.tensor(2.0))])


def test_split_and_merge_tuples_are_views_and_round_trip():
    x = (torch.arange(20.).view(10, 2), torch.arange(10), torch.arange(10) % 2 == 0)
    parts, is_tuple = split(x, 4)
    assert is_tuple and [p[0].shape[0] for p in parts] == [3, 3, 2, 2]
    assert parts[1][0].data_ptr() == x[0][3:].data_ptr()  # a view, not a copy
    back = merge(parts)
    assert all(torch.equal(a, b) for a, b in zip(back, x))


def test_split_rejects_mismatched_batch_sizes_and_non_tensors():
    with pytest.raises(ValueError, match=r"different batch sizes \(dim 0\): \[4, 5\]"):
        split((torch.zeros(4), torch.zeros(5)), 2)
    with pytest.raises(TypeError, match=r"element 1 of x must be a torch.Tensor, got int"):
        split((torch.zeros(4), 3), 2, "x")


def test_balance_even_list_and_params():
    layers = list(mlp(num_layers=5))
    assert resolve_balance(layers, 2) == (3, 2)
    assert resolve_balance(layers, 2, [1, 4]) == (1, 4)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 40)]  # 20, 20, 200 parameters
    assert resolve_balance(layers, 2, "params") == (2, 1)  # 40 | 200, not 20 | 220
    assert resolve_balance(layers, 2, "layers") == resolve_balance(layers, 2, None) == (2, 1)  # the demo's word
    assert min_max_partition([1, 1, 1, 10, 1, 1], 3) == (3, 1, 2)


@pytest.mark.parametrize("balance, message", [
    ([2, 2], "balance=[2, 2] sums to 4 but the model has 5 layers"),
    ([5], "balance has 1 entries but the pipeline has 2 stages"),
    ([0, 5], "every stage needs at least one layer"),
    ("flops", "valid values are None (or 'layers'), 'params' or a list of layer counts"),
])
def test_bad_balance_names_the_numbers(balance, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_balance(list(mlp(num_layers=5)), 2, balance)


def test_too_few_layers_for_the_stages():
    with pytest.raises(ValueError) as info:
        resolve_balance(list(mlp(num_layers=7)), 8)  # e.g. 4 ranks x 2 virtual stages
    assert str(info.value) == (
        "the model has 7 layers but the pipeline needs 8 stages (ranks x virtual_stages); every stage needs at least "
        "one layer: give the model at least 8 layers (split a layer in two, or add layers), or use fewer ranks or "
        "virtual stages, so that ranks x virtual_stages <= 7")


def test_meta_round_trip_and_packing_is_bit_exact():
    tensors = (torch.randn(3, 4, requires_grad=True), torch.tensor([2**62, -5]), torch.tensor([True, False]),
               torch.randn(5, dtype=torch.float64))
    meta = meta_of(tensors, True)
    assert decode_meta(encode_meta(meta)) == meta
    out = unpack(pack(tensors), [(s, d) for s, d, _ in meta[1]])
    assert [o.dtype for o in out] == [torch.float32, torch.int64, torch.bool, torch.float64]
    assert all(torch.equal(a.detach(), b) for a, b in zip(tensors, out))


@pytest.mark.parametrize("tensor", [torch.tensor([[1, -2], [3, 30000]], dtype=torch.int16),
                                    torch.randn(3, 2, dtype=torch.complex64), torch.tensor(7, dtype=torch.int16)])
def test_a_single_tensor_of_a_dtype_nccl_cannot_send_travels_as_bytes(tensor):
    spec = [(tuple(tensor.shape), tensor.dtype)]
    wire = pack((tensor,))
    assert wire.dtype == torch.uint8 and empty_for(spec, "cpu").shape == wire.shape
    (back,) = unpack(wire, spec)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    assert pack((torch.ones(2, 3),)).dtype == torch.float32  # a native dtype travels as itself


def test_grid_layout():
    grid = make_grid(world_rank=5, world_size=6, dp_size=2)
    assert (grid.pp_size, grid.pp_rank, grid.dp_rank) == (3, 2, 1)
    assert grid.pipeline_ranks(1) == (3, 4, 5) and grid.dp_ranks(2) == (2, 5)
    with pytest.raises(ValueError, match="dp_size=4 does not divide the world size 6"):
        make_grid(0, 6, 4)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_microbatches": 0}, ValueError, "num_microbatches must be an integer >= 1, got 0"),
    ({"schedule": "zigzag"}, UnknownScheduleError, "unknown schedule 'zigzag'; valid names: 1f1b, dualpipev, gpipe, interleaved-1f1b, zb-auto, zb-h1, zb-h2, zbv"),
    ({"dp_size": 2}, ValueError, "dp_size=2 does not divide the world size 1"),
    ({"balance": [4, 4]}, ValueError, r"balance has 2 entries but the pipeline has 1 stages"),
    ({"timeout": 0}, ValueError, r"timeout must be a number of seconds > 0 and at most 1e\+09 \(about 31 years: the "
                                 r"store and the process groups take no longer\), got 0"),
    ({"timeout": float("inf")}, ValueError, r"timeout must be a number of seconds > 0 and at most 1e\+09 .*, got inf"),
    ({"timeout": 1e15}, ValueError, r"timeout must be .*, got 1000000000000000\.0"),
    ({"timeout": 2e9}, ValueError, r"timeout must be .*, got 2000000000\.0"),
    ({"timeout": float("nan")}, ValueError, r"timeout must be .*, got nan"),
    ({"timeout": True}, ValueError, r"timeout must be .*, got True"),
    ({"recompute": [True, False]}, ScheduleArgumentError, r"recompute has 2 flags but the program has 1 stages"),
    ({"split_backward": ["no"]}, ScheduleArgumentError, r"split_backward must hold only True or False"),
    ({"loss_fn": "mse"}, TypeError, "loss_fn must be callable, got str"),
])
def test_bad_arguments_fail_before_any_communication(kwargs, error, message):
    args = {"schedule": "1f1b", "num_microbatches": 2, "loss_fn": nn.functional.mse_loss, **kwargs}
    with pytest.raises(error, match=message):
        Pipeline(mlp(num_layers=4), **args)
    assert not dist.is_initialized()


def test_stage_activation_bytes_of_linear_tanh_blocks():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    sizes = stage_activation_bytes(model, torch.randn(4, 16), 2, loss_fn=nn.functional.mse_loss,
                                   target=torch.randn(4, 16))
    row = 4 * 16 * 4  # one (4, 16) float32 tensor
    # stage 0: its input + 2 Tanh outputs (each also the next Linear's input); stage 1: the same + the target;
    # after a recompute the input is held once although the first Linear saves it again
    assert sizes == {"stash_bytes": (3 * row, 4 * row), "input_bytes": (row, row),
                     "recompute_bytes": (3 * row, 4 * row)}


def test_pipeline_error_names_world_and_pipeline_ranks():
    from pipesched.runtime.failure import FailureRecord, PipelineError
    info = FailureRecord(rank=3, pp_rank=1, instr="F1.2", op="F", stage=1, microbatch=2, cause="ValueError: x")
    assert str(PipelineError(info, 2, "while waiting for RECV_B0.2 from pipeline rank 1")) == (
        "pipeline rank failure: world rank 3 (pipeline rank 1) failed at instruction F1.2 (kind F, stage 1, "
        "microbatch 2): ValueError: x [reported to world rank 2: while waiting for RECV_B0.2 from pipeline rank 1]")


class _DeadStore:
    def check(self, keys):
        raise RuntimeError("Connection closed by peer")

    add = compare_set = get = check


def test_a_lost_connection_without_a_record_names_the_lost_rank(monkeypatch):
    """No record can be read and the peer closed the connection: the peer is named as lost, or the store's
    host when the store no longer answers (through the public lost_record, not the Pipeline's private state)."""
    from pipesched.runtime.comm import make_grid
    from pipesched.runtime.failure import CommError, FailureChannel
    from pipesched.runtime.lost_rank import lost_record

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # world rank 0 hosts the store
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [::1]:1")
    exc = CommError("RECV_F1.1 from pipeline rank 0", closed, 0)
    assert exc.connection_lost
    assert not CommError("x", RuntimeError("Timed out waiting 3000ms for recv"), 0).connection_lost
    grid = make_grid(3, 4, 2)  # world rank 3 = pipeline rank 1 of replica 1; its pipeline rank 0 is world rank 2
    found = "world rank 3 (pipeline rank 1) found it while waiting for RECV_F1.1 from pipeline rank 0"
    lost = ("was lost: its process ended in the middle of the step without a failure record (killed, e.g. by SIGKILL "
            "or the out-of-memory killer, or exited)")
    cpu = torch.device("cpu")
    record = lost_record(exc, grid, FailureChannel(MemoryStore(), ["g"]), (None, None), cpu)
    assert (record.rank, record.pp_rank, record.lost) == (2, 0, True)
    assert record.cause == f"world rank 2 (pipeline rank 0) {lost}; {found}: it closed its connection"
    dead = FailureChannel(_DeadStore(), ["g"])
    assert dead.lookup(wait_s=0.0) is None and dead.unreachable
    record = lost_record(exc, grid, dead, (None, None), cpu)
    assert (record.rank, record.pp_rank, record.lost) == (0, 0, True)
    assert record.cause == (f"world rank 0 (pipeline rank 0) {lost}; {found}: it hosts the store, which no longer "
                            f"answers")


class _CountingStore:
    def __init__(self, count):
        self.count = count

    def add(self, key, n):
        self.count += n
        return self.count


def test_a_failing_rank_lingers_until_every_rank_read_its_record_at_most_its_grace():
    from pipesched.runtime.failure import FailureChannel, FailureRecord
    info = FailureRecord(rank=0, id="0:1")
    linger = FailureChannel(_CountingStore(2), ["g"]).keep_alive_for(info, 2, 30.0)  # both ranks have read it
    assert linger() < 10.0  # returns at once, far inside the 30 s grace
    linger = FailureChannel(_CountingStore(1), ["g"]).keep_alive_for(info, 2, 30.0)  # the other rank never reads it
    assert linger(max_s=0.1) < 10.0  # bounded by max_s, not the 30 s grace
    assert linger() == pytest.approx(0.0, abs=5.0)  # nothing left to wait for (nor at interpreter exit)
    assert FailureChannel(_CountingStore(0), ["g"]).keep_alive_for(info, 1, 30.0) is None  # nobody else reads it


def test_clocks_turn_marks_into_seconds_from_the_step_start(monkeypatch):
    from pipesched.runtime.clock import CudaClock, HostClock, clock_for

    host = HostClock()
    assert host.seconds(10.0, [10.5, 12.0]) == [0.5, 2.0]
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaClock)

    class FakeEvent:  # a CUDA event whose GPU time is the order it was recorded in, 4 ms apart
        count = 0

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream):
            self.at_ms = 4.0 * FakeEvent.count
            FakeEvent.count += 1

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, other):
            return other.at_ms - self.at_ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    clock = CudaClock(torch.device("cuda", 0))
    origin, first, second = clock.mark(), clock.mark(), clock.mark()
    assert clock.seconds(origin, [first, second]) == [0.004, 0.008]  # elapsed_time is ms, timelines seconds
    assert first.synced and second.synced


def test_the_stages_device_comes_from_a_parameter_or_buffer_or_the_argument():
    from pipesched.runtime.stage import stage_device

    assert stage_device({0: nn.Sequential(nn.ReLU(), nn.Linear(2, 2))}, None) == torch.device("cpu")
    assert stage_device({1: nn.Sequential(nn.ReLU())}, None) == torch.device("cpu")  # no tensors at all
    assert stage_device({1: nn.Sequential(nn.ReLU())}, "cuda:1") == torch.device("cuda", 1)  # not created


def test_a_mismatched_early_receives_is_named_with_both_values():
    import json

    from pipesched import compile_program, step_programs
    from pipesched.runtime.agreement import agree, describe

    program = compile_program("1f1b", 2, 4)
    early, order = step_programs(program, "gloo", None), step_programs(program, "gloo", False)
    store = MemoryStore()
    for rank, programs in ((1, order), (0, early)):  # rank 1 publishes first, rank 0 then reads both entries
        description = describe(programs.train, [4, 4], 8, 2, programs.early_receives)
        if rank == 1:
            store.set("pipesched/construct/1/1", json.dumps({"description": description}))
            store.add("pipesched/construct/count/1", 1)
            continue
        with pytest.raises(ValueError) as err:
            agree(store, 0, 2, description, timeout=1.0)
    assert str(err.value) == (
        "world rank 1 built its Pipeline with early_receives='False (every message at its program position)' but "
        "world rank 0 with early_receives='True (receives posted up to 16 instructions early)'; every rank must "
        "construct Pipeline with the same arguments (and the same model)")
    # the same arguments agree (None on gloo is early receives, as True)
    same = step_programs(program, "gloo", True)
    assert describe(same.train, [4, 4], 8, 2, same.early_receives) == describe(early.train, [4, 4], 8, 2, 16)
