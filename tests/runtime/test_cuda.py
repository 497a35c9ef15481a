"""The CUDA path: CUDA-event timelines, device peak memory, RNG replay on the device, NCCL messages.

Skipped without a GPU (CI has none). On a machine with one GPU run ``python -m pytest tests/runtime/test_cuda.py``
(the NCCL test needs two GPUs: NCCL will not put two ranks on one device).
"""
import pytest
import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline, launch

from rt_cases import mlp, pair, reference_step, grad_report

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _data(device, n=8, width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g).to(device), torch.randn(n, width, generator=g).to(device)


def one_gpu(rank):
    """p=1 on cuda:0 (no messages): grads equal the unsplit model's, timeline from CUDA events, device peak."""
    device = torch.device("cuda", 0)
    model, ref = pair()
    model, ref = model.to(device), ref.to(device)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss)
    x, y = _data(device)
    loss = pipe.step(x, target=y)
    ref_loss = reference_step(ref, x, y, 4)
    count, equal, worst = grad_report(pipe, model, ref)
    tl = pipe.timeline()
    rng = []
    for flag in (False, True):  # dropout masks replayed on the device: recompute changes nothing
        net = mlp(dropout=0.25).to(device)
        p = Pipeline(net, schedule="gpipe", num_microbatches=4, loss_fn=F.mse_loss, recompute=flag)
        torch.manual_seed(7)
        p.step(x, target=y)
        rng.append([q.grad.clone() for q in p.parameters()])
    return {"loss_close": bool(torch.allclose(loss, ref_loss, rtol=1e-6)), "grads": count, "worst": worst,
            "clock": tl.meta["clock"], "durations": [e.end - e.start for e in tl.events],
            "allocated": pipe.peak_memory_allocated, "activations": pipe.peak_activation_bytes,
            "recompute_bitwise": all(torch.equal(a, b) for a, b in zip(*rng))}


def test_one_gpu_grads_timeline_peak_memory_and_recompute():
    result = launch(one_gpu, 1, timeout=300)[0]
    assert result["loss_close"] and result["grads"] == 16 and result["worst"] <= 1e-6, result
    assert result["clock"] == "cuda events"
    assert len(result["durations"]) == 8 and all(d >= 0 for d in result["durations"])  # p=1, m=4: 4 F + 4 B
    assert isinstance(result["allocated"], int) and result["allocated"] >= result["activations"] > 0
    assert result["recompute_bitwise"] is True


def two_gpus(rank):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model, ref = pair()
    model, ref = model.to(device), ref.to(device)
    out = {}
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, virtual_stages=v)
        for seed in range(2):  # the first step learns the shapes (headers), the second does not
            x, y = _data(device, seed=seed)
            loss = pipe.step(x, target=y)
            ref_loss = reference_step(ref, x, y, 4)
        count, _, worst = grad_report(pipe, model, ref)
        out[schedule] = (bool(torch.allclose(loss, ref_loss, rtol=1e-6)), count, worst,
                         pipe.gather_timeline().meta["clock"])
        pipe.close()
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_two_gpus_over_nccl_match_the_unsplit_model():
    for result in launch(two_gpus, 2, timeout=300):
        for schedule, (loss_close, count, worst, clock) in result.items():
            assert loss_close and count == 8 and worst <= 1e-6 and clock == "cuda events", (schedule, result)


def test_the_stages_cuda_device_is_checked_and_inputs_are_moved_there():
    from torch import nn

    from pipesched.runtime.devices import checked_device, move_to

    current = torch.device("cuda", torch.cuda.current_device())
    assert checked_device({0: nn.Sequential(nn.ReLU())}, "cuda") == current  # no index: the current device
    assert checked_device({0: nn.Sequential(nn.Linear(2, 2).cuda())}, None) == current
    with pytest.raises(ValueError) as info:
        checked_device({0: nn.Sequential(nn.Linear(2, 2))}, "cuda:0")
    assert str(info.value) == ("device='cuda:0', but stage 0's parameter 0.weight (Linear) is on cpu; move the model "
                               "there first (model.to('cuda:0')) or pass device='cpu'")
    count = torch.cuda.device_count()
    with pytest.raises(ValueError) as info:
        checked_device({0: nn.Sequential(nn.ReLU())}, f"cuda:{count}")
    assert str(info.value) == (f"device='cuda:{count}', but this process sees {count} CUDA device(s), "
                               f"cuda:0 to cuda:{count - 1}")
    x = move_to((torch.ones(2), torch.ones(2, device=current)), current, "x")
    assert [t.device for t in x] == [current, current]
