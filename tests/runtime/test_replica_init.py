"""Data parallelism with replicas built from different initial weights (each process seeded by its rank, a common
pattern): as DDP, replica 0's parameters and buffers are copied to every replica at construction
(pipesched/runtime/replica_init.py). Before, the replicas averaged their gradients but applied them to their own
weights: they silently trained different models.

- DP=2 x PP=2 (4 ranks, seed = world rank, so even the two pipeline ranks of a replica differ) and DP=2 x PP=1
  (2 ranks): right after construction every replica holds replica 0's values (float32 parameters, a float64 buffer,
  an int64 buffer; 64-byte buckets on 4 ranks, so several broadcasts per dtype), and after 3 SGD-with-momentum
  steps on their own halves of a batch the replicas' weights are bitwise equal to each other and to the unsplit
  model built from replica 0's initial values, trained in this process on both halves (each half's gradient
  over the same microbatches, averaged as the replicas' all-reduce does: (g0 + g1) / 2).
- a weight tied between the first and last layer across the two pipeline ranks (seed = replica): the replicas
  bitwise equal, the unsplit model within 1e-5 (the tie's 4-way sum adds in another order).
- a checkpoint loaded after construction (load_state_dict of another model's values) wins on every rank.
- a rank failing inside the copy (world rank 3) ends every rank with a PipelineError naming world rank 3 and the
  copy, instead of the others waiting in the broadcast.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipesched.runtime.replica_init as replica_init
from pipesched.runtime import Pipeline, PipelineError, launch

W, STEPS, M, ROWS = 4, 3, 2, 8  # width, steps, microbatches per replica, rows per replica


class Scaled(nn.Module):
    """Linear + Tanh, times a float64 buffer, plus an int64 buffer: buffers a replica must take from replica 0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.register_buffer("scale", torch.rand(W, dtype=torch.float64) + 0.5)
        self.register_buffer("shift", torch.randint(0, 3, (W,)))

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale.float() + self.shift.float() * 0.1


def model(seed, tied=False):
    torch.manual_seed(seed)
    layers = nn.Sequential(Scaled(), Scaled(), Scaled(), nn.Linear(W, W))
    if tied:
        layers[3].weight = layers[0].lin.weight  # a tie across the two pipeline ranks
    return layers


def batch():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2 * ROWS, W, generator=g), torch.randn(2 * ROWS, W, generator=g)) for _ in range(STEPS)]


def body(rank, pp, tied=False, small_buckets=False):
    if small_buckets:
        replica_init.BUCKET_BYTES = 64
    seed = 100 + (rank // pp if tied else rank)
    local = model(seed, tied)
    before = {k: v.clone() for k, v in local.state_dict().items()}
    pipe = Pipeline(local, schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, dp_size=2,
                    balance=[2, 2] if pp == 2 else None)
    initial = {k: v.clone() for k, v in pipe.state_dict().items()}
    changed = any(not torch.equal(before[k], v) for k, v in initial.items())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    shard = slice(ROWS * pipe.grid.dp_rank, ROWS * (pipe.grid.dp_rank + 1))
    for x, y in batch():
        pipe.step(x[shard], target=y[shard])
        opt.step()
        opt.zero_grad()
    out = {"dp_rank": pipe.grid.dp_rank, "pp_rank": pipe.grid.pp_rank, "changed": changed, "initial": initial,
           "final": {k: v.clone() for k, v in pipe.state_dict().items()}}
    other = model(7, tied).state_dict()  # a checkpoint loaded after construction: its values, every rank
    pipe.load_state_dict({k: v for k, v in other.items() if k in initial}, strict=False)
    out["loaded"] = all(torch.equal(v, other[k]) for k, v in pipe.state_dict().items())
    pipe.close()
    return out


def replica_zero_model(pp, tied):
    """The unsplit model replica 0 holds: stage s (layers 2s, 2s+1) built with world rank s's seed (pp=2)."""
    if tied or pp == 1:
        return model(100, tied)
    first, second = model(100), model(101)
    return nn.Sequential(first[0], first[1], second[2], second[3])


def reference(pp, tied):
    ref = replica_zero_model(pp, tied)
    initial = copy.deepcopy(ref.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batch():
        halves = []
        for k in range(2):  # each replica's gradient: its half, microbatch by microbatch, weighted n_i / N
            xs, ys = x[ROWS * k:ROWS * (k + 1)].split(ROWS // M), y[ROWS * k:ROWS * (k + 1)].split(ROWS // M)
            for xm, ym in zip(xs, ys):
                (F.mse_loss(ref(xm), ym) * (xm.shape[0] / ROWS)).backward()
            halves.append({id(p): p.grad.clone() for p in ref.parameters()})
            opt.zero_grad()
        for p in ref.parameters():
            p.grad = (halves[0][id(p)] + halves[1][id(p)]) / 2
        opt.step()
        opt.zero_grad()
    return initial, ref.state_dict()


CASES = {"dp2xpp2": (4, 2, False, True), "dp2xpp1": (2, 1, False, False), "dp2xpp2_tied": (4, 2, True, False)}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    world, pp, tied, small = CASES[request.param]
    return launch(body, world, pp, tied, small, timeout=300), reference(pp, tied), tied


def test_replicas_start_from_replica_0_and_train_the_unsplit_model_bitwise(case):
    results, (initial, final), tied = case
    assert sorted((r["dp_rank"], r["pp_rank"]) for r in results) == sorted(
        (k, p) for k in range(2) for p in range(len(results) // 2))
    for r in results:
        assert r["changed"] is (r["dp_rank"] == 1), r["dp_rank"]  # replica 1's values were overwritten, 0's not
        assert r["initial"], r
        for name, value in r["initial"].items():
            assert torch.equal(value, initial[name]), (r["dp_rank"], r["pp_rank"], name)
        for name, value in r["final"].items():
            if tied:  # the tie's sum over 2 uses x 2 replicas adds in another order than autograd's: 1e-5
                assert torch.allclose(value, final[name], rtol=1e-5, atol=1e-6), (r["dp_rank"], r["pp_rank"], name)
            else:
                assert torch.equal(value, final[name]), (r["dp_rank"], r["pp_rank"], name, value, final[name])
        twin = next(o for o in results if o["pp_rank"] == r["pp_rank"] and o["dp_rank"] != r["dp_rank"])
        assert r["final"].keys() == twin["final"].keys()
        for name, value in r["final"].items():  # the replicas: bitwise equal to each other, always
            assert torch.equal(value, twin["final"][name]), (r["pp_rank"], name)
        assert r["loaded"] is True
    held = set().union(*(r["final"] for r in results))
    tie_copy = {"3.weight"} if tied else set()  # a tied copy is held under the tie's first name (0.lin.weight)
    assert held == set(final) - tie_copy  # every tensor of the model is held by some rank and compared


def fails_in_copy(rank):
    if rank == 3:
        def broken(stages):
            raise RuntimeError("injected failure in the copy")
        replica_init.replica_tensors = broken
    try:  # ranks 0 and 2 (another data-parallel group) finish their copy: their next call learns it
        pipe = Pipeline(model(rank), schedule="1f1b", num_microbatches=M, loss_fn=F.mse_loss, dp_size=2,
                        balance=[2, 2], timeout=120)
    except PipelineError as exc:
        return "construction: " + str(exc)
    try:
        x, y = batch()[0]
        pipe.step(x, target=y)
    except PipelineError as exc:
        return "step: " + str(exc)
    return "stepped"


def test_a_rank_failing_in_the_copy_ends_every_rank_naming_it():
    results = launch(fails_in_copy, 4, timeout=200)
    assert [text.split(":")[0] for text in results] == ["step", "construction", "step", "construction"], results
    for rank, text in enumerate(results):
        assert "world rank 3" in text and "injected failure in the copy" in text, (rank, text)
        assert "copying replica 0's parameters and buffers" in text, (rank, text)
