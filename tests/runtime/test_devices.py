"""A wrong device is a ValueError naming the argument (device, x, target) and both devices, raised before any
work: for the stages at construction, for an input on the rank that checks it (every rank raises it)."""
import pytest
import torch
from torch import nn

from pipesched.runtime import Pipeline, launch
from pipesched.runtime.devices import checked_device, move_to

_META = ("a pipeline runs its stages on cpu (gloo) or cuda (NCCL), not on meta (a meta tensor holds no data to compute "
         "with or send; materialize the model first, e.g. model.to_empty(device='cpu') and initialize it)")


def _stage(*layers):
    return {0: nn.Sequential(*layers)}


def test_device_meta_is_refused_naming_the_argument():
    with pytest.raises(ValueError) as info:
        checked_device(_stage(nn.Linear(2, 2)), "meta")
    assert str(info.value) == f"device='meta', but {_META}"


def test_stages_on_meta_are_refused_naming_their_first_tensor():
    with pytest.raises(ValueError) as info:
        checked_device(_stage(nn.ReLU(), nn.Linear(2, 2, device="meta")), None)
    assert str(info.value) == ("device=None: the stages' device is that of their first tensor, stage 0's parameter "
                               f"1.weight (Linear), on meta, but {_META}")


def test_a_stage_tensor_off_the_requested_device_names_both():
    with pytest.raises(ValueError) as info:
        checked_device(_stage(nn.Linear(2, 2, device="meta")), "cpu")
    assert str(info.value) == ("device='cpu', but stage 0's parameter 0.weight (Linear) is on meta; materialize the "
                               "model there first (model.to_empty(device='cpu'), then initialize it)")


def test_a_rank_with_layers_on_two_devices_is_refused():
    with pytest.raises(ValueError) as info:
        checked_device({3: nn.Sequential(nn.Linear(2, 2)), 5: nn.Sequential(nn.Linear(2, 2, device="meta"))}, None)
    assert str(info.value) == ("device=None: the stages' device is that of their first tensor, stage 3's parameter "
                               "0.weight (Linear), on cpu, but stage 5's parameter 0.weight (Linear) is on meta; "
                               "materialize the model there first (model.to_empty(device='cpu'), then initialize it)")


def test_a_buffer_counts_like_a_parameter():
    norm = nn.BatchNorm1d(2)
    norm.running_mean = torch.zeros(2, device="meta")
    with pytest.raises(ValueError) as info:
        checked_device(_stage(norm), None)
    assert str(info.value).endswith("but stage 0's buffer 0.running_mean (BatchNorm1d) is on meta; materialize the "
                                    "model there first (model.to_empty(device='cpu'), then initialize it)")


def test_a_device_that_is_no_device():
    with pytest.raises(ValueError, match=r"^device='gpu' is not a device: "):
        checked_device(_stage(nn.Linear(2, 2)), "gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda():
    with pytest.raises(ValueError) as info:
        checked_device(_stage(nn.ReLU()), "cuda")
    assert str(info.value) == ("device='cuda', but CUDA is not available in this process "
                               "(torch.cuda.is_available() is False); run the stages on cpu")


def test_cpu_stages_and_stages_without_tensors():
    assert checked_device(_stage(nn.Linear(2, 2)), None) == torch.device("cpu")
    assert checked_device(_stage(nn.ReLU()), None) == torch.device("cpu")
    assert checked_device(_stage(nn.Linear(2, 2)), "cpu") == torch.device("cpu")


def test_inputs_on_meta_are_named_and_non_tensors_are_left_for_split():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError) as info:
        move_to(torch.zeros(2, device="meta"), cpu, "target")
    assert str(info.value) == ("target is on the meta device, which holds no data, and cannot be moved to the "
                               "stages' device cpu; pass target with its values (on cpu)")
    with pytest.raises(ValueError, match=r"^x\[1\] is on the meta device"):
        move_to((torch.zeros(2), torch.zeros(2, device="meta")), cpu, "x")
    assert move_to("abc", cpu, "x") == "abc"
    assert move_to([torch.zeros(1), 3], cpu, "x")[1] == 3


def _wrong_devices(rank):
    """Each case: the message this rank raised, then whether the pipeline still trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    out = {}
    try:
        Pipeline(model, num_microbatches=2, loss_fn=nn.functional.mse_loss, device="meta", timeout=30)
    except ValueError as exc:
        out["device"] = str(exc)
    pipe = Pipeline(model, num_microbatches=2, loss_fn=nn.functional.mse_loss, timeout=30)
    x, y, meta = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4, device="meta")
    for name, args in (("x", (meta, y)), ("target", (x, meta)), ("x str", ("abc", y))):
        try:
            pipe.step(*args)
        except ValueError as exc:
            out[name] = str(exc)
    out["then"] = float(pipe.step(x, y))
    return out


@pytest.mark.multiprocess
def test_wrong_devices_on_two_ranks_are_value_errors_on_both_and_the_pipeline_stays_usable():
    first, last = launch(_wrong_devices, 2, timeout=120)
    for out in (first, last):
        assert out["device"] == f"device='meta', but {_META}"
    x_error = ("x is on the meta device, which holds no data, and cannot be moved to the stages' device cpu; "
               "pass x with its values (on cpu)")
    assert first["x"] == x_error
    assert last["x"] == f"the rank of stage 0 (pipeline rank 0) rejected the step input: {x_error}"
    target_error = x_error.replace("x", "target")
    assert last["target"] == target_error
    assert first["target"] == f"the rank of the last stage (pipeline rank 1) rejected the step's target: {target_error}"
    assert first["x str"] == "x must be a tensor or a non-empty tuple or list of tensors, got str"
    assert first["then"] == last["then"] and first["then"] > 0
