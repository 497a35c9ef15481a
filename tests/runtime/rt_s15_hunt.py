"""Per-rank bodies of tests/runtime/test_s15_hunt.py (2 spawned gloo ranks): settings changed between steps
that the step's own bookkeeping must follow, checked against the unsplit model bitwise."""
from __future__ import annotations

import copy
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, save_checkpoint

from rt_cases import reference_step
from rt_workers import _data


def _grads(pipe, model, ref):
    """(this rank's parameters, whether each one's .grad is the unsplit model's: both None or bitwise equal)."""
    mine = {id(p) for p in pipe.parameters()}
    ref_params = dict(ref.named_parameters())
    pairs = [(p.grad, ref_params[name].grad) for name, p in model.named_parameters() if id(p) in mine]
    return len(pairs), all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in pairs)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # cut: [0, 1] | [2, 3]


def input_grad_between_steps(rank, schedule, frozen=False):
    """Steps whose x needs no gradient, then one, then none: x.grad as the unsplit model's (bitwise; None on the
    ranks without stage 0) and parameter gradients bitwise, each step. ``frozen``: stage 0 has no trainable
    parameters, so x.requires_grad alone decides whether stage 0's output requires grad."""
    model = _model()
    if frozen:
        for p in [*model[0].parameters(), *model[1].parameters()]:
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    out = []
    for step, wants in enumerate((False, True, False)):
        x, y = _data(step)
        x_ref = x.clone().requires_grad_(wants)
        x.requires_grad_(wants)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x_ref, y, 2)
        grads_equal = x.grad is None if rank else (x.grad is None) == (x_ref.grad is None) and (
            x.grad is None or torch.equal(x.grad, x_ref.grad))
        count, equal = _grads(pipe, model, ref)
        out.append((bool(torch.equal(loss, ref_loss)), bool(grads_equal), count, equal))
        model.zero_grad(), ref.zero_grad()
    pipe.close()
    return out


def inplace_set_later(rank, schedule, recompute=False):
    """``inplace=True`` set on stage 1's first layer (an nn.ReLU) after the Pipeline was built: the stage gets a
    copy of its input, as one built that way does; loss and gradients bitwise the unsplit model's."""
    model = _model()
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, schedule=schedule, num_microbatches=2, loss_fn=F.mse_loss, recompute=recompute,
                    timeout=60)
    out = []
    for step in range(2):
        if step == 1:
            model[2].inplace = ref[2].inplace = True
        x, y = _data(step)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 2)
        count, equal = _grads(pipe, model, ref)
        out.append((bool(torch.equal(loss, ref_loss)), count, equal))
        model.zero_grad(), ref.zero_grad()
    pipe.close()
    return out


class NoisyLinear(nn.Module):
    """A Linear whose output is masked by numbers drawn from the layer's own generator (not torch's global one)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        gen = self.gens[0] if "gens" in self.__dict__ else self.gen
        return self.lin(x) * (torch.rand(x.shape[0], 8, generator=gen) > 0.3)


def _noisy_model(holder: str):
    """4 NoisyLinear layers whose generators are held as ``holder`` says: ``"attr"`` (self.gen), ``"list"``
    (self.gens = [gen]) or ``"class"`` (in the class body; new classes per model, so that the reference has its
    own)."""
    torch.manual_seed(0)
    if holder == "class":  # a class per layer: one generator shared by layers on two ranks cannot draw as unsplit
        layers = [type(f"ClassNoisy{k}", (NoisyLinear,), {"gen": torch.Generator().manual_seed(k)})(0)
                  for k in range(4)]
        for layer in layers:
            del layer.gen  # the class's from now on
        return nn.Sequential(*layers)
    layers = [NoisyLinear(seed) for seed in range(4)]
    if holder == "list":
        for layer in layers:
            layer.gens = [layer.__dict__.pop("gen")]
    return nn.Sequential(*layers)


def own_generator_recomputed(rank, schedule, holder="attr"):
    """recompute=True on layers drawing from their own generators: loss and gradients bitwise the unsplit
    model's over two steps (the re-run replays each generator's state at F, and puts back the later one)."""
    model, ref = _noisy_model(holder), _noisy_model(holder)  # same weights and generator seeds
    pipe = Pipeline(model, schedule=schedule, num_microbatches=4, loss_fn=F.mse_loss, recompute=True, timeout=60)
    out = []
    for step in range(2):
        x, y = _data(step)
        loss = pipe.step(x, target=y)
        ref_loss = reference_step(ref, x, y, 4)
        out.append((bool(torch.equal(loss, ref_loss)), *_grads(pipe, model, ref)))
        model.zero_grad(), ref.zero_grad()
    pipe.close()
    return out


def forward_small_batch(rank):
    """``forward()`` of a batch smaller than m (a last evaluation batch): refused on every rank, naming the call."""
    pipe = Pipeline(_model(), num_microbatches=2, loss_fn=F.mse_loss, timeout=60)
    got = _outcome(lambda: pipe.forward(torch.randn(1, 8)))[:2]
    pipe.close()
    return got


def suite(rank):
    out = {}
    for schedule in ("1f1b", "zbv"):
        out[f"input-grad-{schedule}"] = input_grad_between_steps(rank, schedule)
        out[f"input-grad-frozen-{schedule}"] = input_grad_between_steps(rank, schedule, frozen=True)
        out[f"inplace-later-{schedule}"] = inplace_set_later(rank, schedule)
    out["inplace-later-recompute"] = inplace_set_later(rank, "gpipe", recompute=True)
    for schedule in ("1f1b", "zbv"):
        out[f"own-generator-{schedule}"] = own_generator_recomputed(rank, schedule)
    for holder in ("class", "list"):
        out[f"own-generator-{holder}"] = own_generator_recomputed(rank, "1f1b", holder)
    out["forward-small-batch"] = forward_small_batch(rank)
    return out


# ---- ranks that diverge around a checkpoint (each case its own launch: they end Pipelines) --------------------


def _pipe(timeout):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    pipe = Pipeline(model, num_microbatches=2, loss_fn=F.mse_loss, timeout=timeout)
    pipe.step(torch.randn(8, 4), target=torch.randn(8, 4))
    return pipe


def _outcome(call):
    """(exception type name or "ok", its text, seconds the call took)."""
    start = time.monotonic()
    try:
        call()
        return "ok", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return type(exc).__name__, str(exc), time.monotonic() - start


def save_while_peer_exits(rank, folder):
    """World rank 1's launch fn returns after a step (its Pipeline dropped unclosed) while rank 0 saves: rank 0's
    vote sees rank 1's departure at once (timeout 60 s)."""
    pipe = _pipe(timeout=60)
    if rank == 1:
        return "left"
    time.sleep(0.5)  # rank 1's fn has returned by now
    return _outcome(lambda: save_checkpoint(f"{folder}/ck", pipe, step=1))


def save_after_close(rank, folder):
    """Every rank closes its Pipeline, then saves: the save still works (a closed record is no departure)."""
    pipe = _pipe(timeout=30)
    pipe.close()
    return _outcome(lambda: save_checkpoint(f"{folder}/ck", pipe, step=1))


def save_on_rank_0_only(rank, folder, stay):
    """``if rank == 0: save_checkpoint(...)`` while rank 1 opens its next step (timeout 3 s): both calls end after
    the timeout, each naming the other's call. ``stay``: rank 0 stays until rank 1's step has ended (else its launch
    fn returns at once, and rank 1 may see it gone first)."""
    pipe = _pipe(timeout=3)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    if rank == 0:
        got = _outcome(lambda: save_checkpoint(f"{folder}/ck", pipe, step=1))
        if stay:  # until rank 1's step has ended: it then sees rank 0 alive, not gone
            dist.distributed_c10d._get_default_store().wait(["s15/step-ended"], datetime.timedelta(seconds=60))
        return got
    got = _outcome(lambda: pipe.step(x, target=y))
    dist.distributed_c10d._get_default_store().set("s15/step-ended", "1")
    return got


def clip_on_one_rank(rank):
    """Rank 1 calls clip_grad_norm_ while rank 0 opens its next step: each raises its own PipelineError (both found
    the calls differ), rank 1's naming the public call it failed in."""
    pipe = _pipe(timeout=30)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    return _outcome(lambda: pipe.clip_grad_norm_(1.0) if rank == 1 else pipe.step(x, target=y))[:2]


def stall_with_replicas(rank):
    """DP 2 x PP 2: world rank 1 pauses past the timeout (4 s) between steps: (err.stalled, seconds) on each rank."""
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), num_microbatches=2,
                    loss_fn=F.mse_loss, dp_size=2, timeout=4)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, target=y)
    if rank == 1:
        time.sleep(8)
    try:
        pipe.step(x, target=y)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return type(exc).__name__, getattr(exc, "stalled", None)


def other_width_on_rank_1(rank):
    """Rank 1 builds its model 16 wide where rank 0 builds it 8 wide: the refusal's text on each rank."""
    width = 8 if rank == 0 else 16
    try:
        Pipeline(nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]), num_microbatches=4, loss_fn=F.mse_loss)
    except ValueError as exc:
        return str(exc)
    return "built"


def save_after_a_peer_was_lost(rank, folder):
    """World rank 1's process ends (os._exit) between steps; rank 0's step names it lost; rank 0's emergency save
    then ends at once naming it too (timeout 60 s). Rank 0's outcomes go to a file: launch raises for rank 1."""
    pipe = _pipe(timeout=60)
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    got = [_outcome(lambda: pipe.step(torch.randn(8, 4), target=torch.randn(8, 4))),
           _outcome(lambda: save_checkpoint(f"{folder}/ck", pipe, step=1))]
    with open(f"{folder}/rank0.json", "w") as out:
        json.dump(got, out)
    return got


def old_vote_not_named(rank, folder):
    """Rank 0 alone calls save_checkpoint (timeout 2 s) and catches its TimeoutError; 8 s later both ranks step;
    then rank 0 pauses 7 s: rank 1's step times out, and its error must not name that old vote."""
    pipe = _pipe(timeout=2)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        _outcome(lambda: save_checkpoint(f"{folder}/ck", pipe, step=1))
        store.set("s15/saved", "1")
    else:
        store.wait(["s15/saved"], datetime.timedelta(seconds=60))
    time.sleep(8)  # more than the 5 s of slack a round given up on keeps (pipeline_failure._VOTE_SLACK_S)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    first = _outcome(lambda: pipe.step(x, target=y))[0]
    if rank == 0:
        time.sleep(7)
    return first, _outcome(lambda: pipe.step(x, target=y))[:2]
