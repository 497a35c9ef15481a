"""A recompute runs a stage's forward on scratch copies of its buffers (``BufferLedger`` / ``replayed()``, and
``scratch_buffers`` for the W of a split backward). Buffers that are different tensors over one memory (a counter's
buffer and another layer's ``calls.view(())`` or ``calls[1:]``) were copied separately: a forward that writes one
and reads the other read a stale value in its recompute, and rank 0's gradients silently differed from the unsplit
model's (bitwise equal with one shared buffer object, or without recompute). Now the copies share memory as the
originals do. 2 forked gloo ranks, 6 layers, the aliased pair at layers 1 and 2 in stage 0, recompute on every
stage, under 1f1b (5 + 1) and zbv (3 + 1 + 1 + 1, split I/W), 2 SGD steps of 2 microbatches each."""
import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.recompute import BufferLedger, scratch_buffers

import rt_recompute_aliases as rt

KINDS = ("counter_view", "counter_slice", "table_view")
#: the Counter's buffer on rank 0 after 2 steps of 2 microbatches: the recomputes added nothing
COUNTS = {"counter_view": [4], "counter_slice": [[4, 8, 12]], "table_view": []}


@pytest.fixture(scope="module")
def results():
    return launch(rt.suite, 2, timeout=300, start_method="fork")


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(rt.SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_recomputed_buffers_over_one_memory_train_bitwise_as_the_unsplit_model(results, kind, schedule):
    for rank, by_case in enumerate(results):
        got = by_case[(kind, schedule)]
        assert len(got["steps"]) == 2, got
        for loss, expected, count, equal in got["steps"]:
            assert (loss, count, equal) == (expected, 4 if rank == 0 else 2, True), got
        assert got["same_state"], got
        assert got["counts"] == (COUNTS[kind] if rank == 0 else []), got
    names = {"table_view": ["1.table", "2.t"]}.get(kind, ["1.calls", "2.c"])
    assert set(names) <= set(results[0][(kind, schedule)]["checked"]), results[0]


# ---- the scratch copies themselves (no ranks) -----------------------------------------------------------------

def _aliased():
    counter = rt.Counter((3,))
    reader = rt.Reader(counter.calls[1:])
    table = rt.Table()
    return nn.Sequential(counter, reader, table, rt.TableView(table)), counter, reader, table


def _shares_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_scratch_buffers_share_memory_as_the_module_s_do_and_leave_them_untouched():
    """The W of a split backward recomputes a checkpointed region inside ``scratch_buffers``."""
    module, counter, reader, table = _aliased()
    with scratch_buffers(module):
        assert _shares_memory(counter.calls, reader.c) and _shares_memory(table.table, module[3].t)
        assert (reader.c.storage_offset(), tuple(reader.c.shape), reader.c.stride()) == (1, (2,), (1,))
        counter(None)
        assert reader.c.tolist() == [2, 3]
    assert counter.calls.tolist() == [0, 0, 0] and reader.c.tolist() == [0, 0]
    assert _shares_memory(counter.calls, reader.c)  # the module's own tensors are back


def test_a_replayed_snapshot_has_the_forward_s_values_over_one_memory():
    module, counter, reader, table = _aliased()
    ledger = BufferLedger()
    counter(None)
    snap = ledger.snapshot(module)
    assert snap.nbytes == 3 * 8 + 4 * 4  # one clone of each memory: the counter's 3 int64, the table's 4 floats
    counter(None)  # a later forward
    later = ledger.snapshot(module)
    assert later.nbytes == 3 * 8  # the unchanged table's clone is shared with the earlier snapshot
    for _ in range(2):  # replayed twice: each time on fresh copies of the snapshot
        with snap.replayed():
            assert counter.calls.tolist() == [1, 2, 3] and reader.c.tolist() == [2, 3]
            counter(None)
            assert reader.c.tolist() == [4, 6]
    assert counter.calls.tolist() == [2, 4, 6] and reader.c.tolist() == [4, 6]
    with later.replayed():
        assert reader.c.tolist() == [4, 6]


def test_a_view_of_another_dtype_over_part_of_a_buffer_is_rebuilt_at_its_offset():
    owner = nn.Module()
    owner.register_buffer("table", torch.arange(8, dtype=torch.float32))
    viewer = nn.Module()
    viewer.register_buffer("bits", owner.table.view(torch.int64)[1:3])  # bytes 8..24 as int64
    viewer.register_buffer("strided", owner.table[3:8:2])
    module = nn.Sequential(owner, viewer)
    expected = (viewer.bits.tolist(), viewer.strided.tolist())
    with scratch_buffers(module):
        assert (viewer.bits.tolist(), viewer.strided.tolist()) == expected
        assert viewer.strided.stride() == (2,) and viewer.bits.dtype == torch.int64
        owner.table[3] = -1.0
        assert viewer.strided.tolist() == [-1.0, 5.0, 7.0]
        assert viewer.bits.tolist()[0] != expected[0][0]  # bytes 12..16 are the int64's high half
    assert owner.table[3].item() == 3.0
