"""The only texts pipesched reads from exceptions (pipesched.runtime.torch_errors), pinned against what this torch
really raises; and the failure records published to the store."""
import pickle

import pytest
import torch
from torch import nn

from pipesched.runtime import launch
from pipesched.runtime.failure import CommError, FailureRecord, PipelineError
from pipesched.runtime.torch_errors import inplace_on_leaf, peer_closed_connection

import rt_torch_errors


def test_autograd_refusing_an_in_place_op_on_a_leaf_is_recognised():
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        nn.ReLU(inplace=True)(leaf)
    assert inplace_on_leaf(info.value)
    with pytest.raises(RuntimeError) as other:
        torch.ones(2) @ torch.ones(3)
    assert not inplace_on_leaf(other.value)
    assert not inplace_on_leaf(ValueError("a leaf Variable that requires grad is being used in an in-place operation"))


@pytest.mark.multiprocess
def test_gloo_tells_a_closed_connection_from_a_timeout_only_by_its_text():
    found = launch(rt_torch_errors.gloo_errors, 2, timeout=120)[0]
    assert found["timeout"][0] == found["closed"][0] == "RuntimeError", found  # no type to tell them apart
    assert not peer_closed_connection(RuntimeError(found["timeout"][1])), found
    assert peer_closed_connection(RuntimeError(found["closed"][1])), found


def test_comm_error_carries_whether_the_peer_closed_the_connection():
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:10670. This is typically caused by a remote worker crashing.")
    timed_out = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv "
                             "operation to complete")
    assert CommError("RECV_F1.1 from pipeline rank 0", closed, 0).connection_lost is True
    assert CommError("RECV_F1.1 from pipeline rank 0", timed_out, 0).connection_lost is False


def test_a_failure_record_round_trips_through_the_store_format_and_pickle():
    try:
        raise ValueError("boom")
    except ValueError as exc:
        record = FailureRecord.local(3, None, exc, pp_rank=1)
    assert (record.rank, record.pp_rank, record.instr, record.cause, record.lost) == (3, 1, None, "ValueError: boom",
                                                                                        False)
    assert record.id.startswith("3:") and "raise ValueError" in record.traceback
    assert FailureRecord.from_json(record.to_json()) == record
    error = pickle.loads(pickle.dumps(PipelineError(record, 0, "while waiting")))
    assert (error.record, error.seen_by, str(error)) == (record, 0, str(PipelineError(record, 0, "while waiting")))
