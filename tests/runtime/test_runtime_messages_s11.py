"""A forward that raises on a rank says what its stage received, shapes and dtypes (trial: "shape and dtype
surprises between stages"), or what loss_fn got; the same text on every rank. One launch of 2 gloo ranks runs
every case (rt_messages_s11.suite); the description itself is tested in this process."""
import pytest
import torch

from pipesched.runtime import launch
from pipesched.runtime.failure import FailureRecord, PipelineError
from pipesched.runtime.received import loss_input_text, stage_input_text, value_text

import rt_messages_s11

pytestmark = pytest.mark.multiprocess

HEAD = "pipeline rank failure: world rank {0} (pipeline rank {0}) failed at instruction F{0}.0 (kind F, stage {0}, " \
       "microbatch 0): "
EXPECTED = {  # case: (failing rank, message on that rank)
    "shapes": (1, HEAD.format(1) + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x16 and 8x16); its "
               "input (from stage 0 on pipeline rank 0): tensor (3, 16) float32"),
    "dtype": (1, HEAD.format(1) + "RuntimeError: mat1 and mat2 must have the same dtype, but got Half and Float; its "
              "input (from stage 0 on pipeline rank 0): tensor (3, 8) float16"),
    "first": (0, HEAD.format(0) + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x4 and 8x16); its input "
              "(the step's x, microbatch 0): tuple (tensor (3, 4) float32, tensor (3,) int64, tensor (3,) int64, "
              "... (5 tensors))"),
    "loss": (1, HEAD.format(1) + "RuntimeError: The size of tensor a (16) must match the size of tensor b (8) at "
             "non-singleton dimension 1; loss_fn got output tensor (3, 16) float32 and target tensor (3, 8) float32"),
    "eval": (1, HEAD.format(1) + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x16 and 8x16); its "
             "input (from stage 0 on pipeline rank 0): tensor (3, 16) float32"),  # forward(): no autograd
}


@pytest.fixture(scope="module")
def ranks():
    return launch(rt_messages_s11.suite, 2, timeout=300)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_failed_forward_says_what_its_stage_received_on_every_rank(ranks, case):
    origin, said = EXPECTED[case]
    received = said.split("; ", 1)[1]
    for rank, results in enumerate(ranks):
        got = results[case]
        assert (got["type"], got["instr"], got["received"]) == ("PipelineError", f"F{origin}.0", received), (rank, got)
        assert got["cause"] == said[len(HEAD.format(origin)):].split("; ", 1)[0], (rank, got)
        if rank == origin:
            assert got["message"] == said, (rank, got)
        else:  # the other rank adds what it was waiting for (which message: a matter of timing)
            assert got["message"].startswith(f"{said} [reported to world rank {rank}: while waiting for "), got
            assert got["message"].endswith("]"), got


# ---- the descriptions, in this process -------------------------------------------------------------------------

def test_value_text_names_shapes_and_dtypes_compactly():
    assert value_text(torch.zeros(3, 16, dtype=torch.float16)) == "tensor (3, 16) float16"
    assert value_text(torch.tensor(1.0)) == "tensor () float32"
    assert value_text((torch.zeros(2, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool))) == (
        "tuple (tensor (2,) int64, tensor (2, 3) bool)")
    assert value_text([torch.zeros(1)] * 7) == (
        "list (tensor (1,) float32, tensor (1,) float32, tensor (1,) float32, ... (7 tensors))")
    assert value_text({"a": torch.zeros(2), "b": [1, (torch.ones(()), 2)], "c": None, "d": 3}) == (
        "dict ('a': tensor (2,) float32, 'b': list (int, tuple of 2), 'c': None, ... (4 items))")


def test_stage_and_loss_texts():
    x = torch.zeros(3, 16, dtype=torch.float16)
    assert stage_input_text(1, 2, (x,), False, 0) == "its input (from stage 0 on pipeline rank 0): tensor (3, 16) float16"
    assert stage_input_text(0, 1, (x, x), True, None) == (
        "its input (the step's x, microbatch 1): tuple (tensor (3, 16) float16, tensor (3, 16) float16)")
    assert stage_input_text(0, 0, (), False, None) is None  # cannot be described: left out, never raises
    assert loss_input_text(torch.zeros(3, 16), torch.zeros(3, 8)) == (
        "loss_fn got output tensor (3, 16) float32 and target tensor (3, 8) float32")
    assert loss_input_text(torch.zeros(3, 16), None) == "loss_fn got output tensor (3, 16) float32 and no target"


def test_pipeline_error_says_received_after_the_cause_and_before_the_report():
    info = FailureRecord(rank=3, pp_rank=1, instr="F1.2", op="F", stage=1, microbatch=2, cause="ValueError: x",
                         received="its input (from stage 0 on pipeline rank 0): tensor (2, 8) float32")
    again = FailureRecord.from_json(info.to_json())  # as the other ranks read it
    assert str(PipelineError(again, 2, "while waiting for RECV_B0.2 from pipeline rank 1")) == (
        "pipeline rank failure: world rank 3 (pipeline rank 1) failed at instruction F1.2 (kind F, stage 1, "
        "microbatch 2): ValueError: x; its input (from stage 0 on pipeline rank 0): tensor (2, 8) float32 "
        "[reported to world rank 2: while waiting for RECV_B0.2 from pipeline rank 1]")


def test_a_failed_backward_says_nothing_of_an_input(ranks):
    said = ("pipeline rank failure: world rank 1 (pipeline rank 1) failed at instruction B1.0 (kind B, stage 1, "
            "microbatch 0): RuntimeError: bad backward")
    for rank, results in enumerate(ranks):
        got = results["backward"]
        assert (got["type"], got["instr"], got["received"]) == ("PipelineError", "B1.0", None), (rank, got)
        if rank == 1:
            assert got["message"] == said
        else:
            assert got["message"].startswith(f"{said} [reported to world rank 0: while waiting for "), got
