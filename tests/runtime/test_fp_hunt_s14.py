"""Hunt (fp14) on the session-14 runtime changes: lists between stages (7912d3f) and the as-built check (built.py).

1. A stage whose first layer has ``inplace=True`` is a ``ClonedInputStage`` that runs on a copy of its input (README:
   "a first layer with inplace=True ... is supported: it gets a copy"). It cloned a tensor or a tuple, but once
   lists arrived as lists it did not clone a list: the layer's in-place write hit the received leaf and the step
   failed ("stage 1 modifies its input in place"). Fixed: ``microbatch.cloned`` (also profiling's copy). Expected:
   the step succeeds and the gradients equal the unsplit model's bitwise.

2. A layer that creates a parameter-free child module in its first forward (``self.act = nn.Tanh()`` on first call, a
   lazy-building pattern), or a parameter-free child swapped between steps (``block.act = nn.Tanh()``), was refused
   by the next step ("a module inside this rank's layers was added, removed or replaced"), although no parameter
   changed and nothing the Pipeline holds is stale. Fixed: ``Built`` compares parameter objects. Expected: step 2
   runs and its gradients equal the unsplit model's bitwise.
"""
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError, launch


class _Two(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a, self.kind = nn.Linear(4, 4), kind

    def forward(self, x):
        return self.kind([torch.tanh(self.a(x)), self.a(x) * 2])


class _ScaleSecond(nn.Module):
    """Writes its input in place, and says so as nn.ReLU(inplace=True) does."""

    def __init__(self):
        super().__init__()
        self.inplace = True

    def forward(self, xs):
        xs[1].mul_(2)
        return xs[0] + xs[1]


def _inplace_model(kind):
    torch.manual_seed(0)
    return nn.Sequential(_Two(kind), _ScaleSecond(), nn.Linear(4, 4))


def _inplace_rank(rank, kind):
    torch.set_num_threads(1)
    model, ref = _inplace_model(kind), _inplace_model(kind)
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=1, loss_fn=F.mse_loss, balance=[1, 2], timeout=30.0)
    x, y = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(2, 4)
    try:
        pipe.step(x, target=y)
    except PipelineError as exc:
        return str(exc)
    finally:
        pipe.close()
    F.mse_loss(ref(x), y).backward()
    return [torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if p.grad is not None]


def test_a_list_into_a_stage_whose_first_layer_is_inplace_gets_a_copy_as_a_tuple_does():
    for kind in (tuple, list):
        for rank, got in enumerate(launch(_inplace_rank, 2, kind, timeout=120)):
            # expected: no failure, and every gradient of this rank bitwise the unsplit model's
            assert isinstance(got, list) and got and all(got), (kind.__name__, rank, got)


class _MakesChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if not hasattr(self, "act"):
            self.act = nn.Tanh()  # a parameter-free child built on first use
        return self.act(self.fc(x))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x))


def _child_rank(rank, how):
    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[(_MakesChild if how == "lazy" else _Block)() for _ in range(4)])

    model, ref = build(), build()
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, timeout=30.0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    pipe.step(x, target=y)
    for m in (model, ref):
        for p in m.parameters():
            p.grad = None
        if how == "swap":
            for block in m:
                block.act = nn.Tanh()  # a parameter-free child replaced by an equal one
    try:
        pipe.step(x, target=y)
    except ValueError as exc:
        return str(exc)
    finally:
        pipe.close()
    for xi, yi in zip(x.tensor_split(2), y.tensor_split(2)):
        (F.mse_loss(ref(xi), yi) * (xi.shape[0] / x.shape[0])).backward()
    ref_grads = dict(ref.named_parameters())
    return [torch.equal(p.grad, ref_grads[k].grad) for k, p in model.named_parameters() if p.grad is not None]


def test_a_parameter_free_child_created_in_forward_is_not_refused():
    for rank, got in enumerate(launch(_child_rank, 2, "lazy", timeout=120)):
        # expected: step 2 runs (no ValueError) and this rank's 4 gradients equal the unsplit model's bitwise
        assert isinstance(got, list) and len(got) == 4 and all(got), (rank, got)


def test_a_parameter_free_child_swapped_between_steps_is_not_refused():
    for rank, got in enumerate(launch(_child_rank, 2, "swap", timeout=120)):
        assert isinstance(got, list) and len(got) == 4 and all(got), (rank, got)


def test_profile_layers_and_stage_activation_bytes_copy_a_list_for_an_inplace_layer_as_a_tuple():
    """Same root cause in the single-process tools: profiling's ``_copied`` and ``ClonedInputStage`` copy a tuple,
    not a list (profile_layers: AttributeError 'list' object has no attribute 'clone'; stage_activation_bytes:
    RuntimeError a leaf Variable that requires grad is being used in an in-place operation). Expected: both run
    for the list model as they do for the tuple one."""
    from pipesched.runtime import profile_layers, stage_activation_bytes

    seen = {}
    for kind in (tuple, list):
        profile = profile_layers(_inplace_model(kind), torch.randn(4, 4), torch.zeros(4, 4), F.mse_loss, repeat=1,
                                 warmup=0)
        assert profile.num_layers == 3, kind
        seen[kind] = stage_activation_bytes(_inplace_model(kind), torch.randn(4, 4), 2, balance=[1, 2],
                                            loss_fn=F.mse_loss, target=torch.zeros(4, 4))
    assert seen[list] == seen[tuple]  # the same tensors saved, whatever the container
