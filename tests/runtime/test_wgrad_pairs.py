"""Paired weight gradients (``Pipeline(pair_weight_grads=True)``, ``runtime/wgrad_fusion.Pairing``): a fused ``W``
whose stage has a later ``W`` in the rank's stream keeps its GEMM, the next one runs one ``addmm_`` over both
microbatches' rows. How many GEMMs run, which ``W`` may wait (never a stage's last, so nothing is pending when a
``.grad`` is read), and a Pipeline with it on 2 and 4 forked gloo ranks against the unsplit model and fusion
alone."""
import pytest
import torch
from torch import nn

import pipesched
from pipesched.ir import Op
from pipesched.runtime import launch
from pipesched.runtime.executor import later_weight_grads
from pipesched.runtime.split import SplitPlans, backward_input, backward_weight
from pipesched.runtime.wgrad_fusion import Pairing, PairStats, run_pending

import rt_wgrad_pairs as rt


def _stage():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 5))


@pytest.fixture
def addmm_calls(monkeypatch):
    """Counts ``Tensor.addmm_`` and ``torch.mm`` calls from Python (the fused and paired GEMMs, the ones making
    ``.grad``; autograd's own are not)."""
    calls = []
    original, original_mm = torch.Tensor.addmm_, torch.mm

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[1])  # K: rows of the GEMM
        return original(self, *args, **kwargs)

    def counted_mm(a, b, *args, **kwargs):
        calls.append(a.shape[1])
        return original_mm(a, b, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "addmm_", counted)
    monkeypatch.setattr(torch, "mm", counted_mm)
    return calls


def _grads(m, pairs, rows=4, seed=0):
    """``m`` microbatches of a 2-Linear stage through I then W, W fused, from ``.grad`` None, the W of
    microbatch i waiting when ``pairs`` and i < m - 1 (the executor's rule for one stage's W in stream order).
    Returns (gradients, PairStats, what is still pending)."""
    stage = _stage()
    stage.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(seed)
    plans, params = SplitPlans(), list(stage.parameters())
    pending, stats = {}, PairStats()
    for i in range(m):
        x = torch.randn(rows, 8, generator=g).requires_grad_()
        y = stage(x)
        _, work = backward_input([y], [torch.randn(y.shape, generator=g)], [x], params, plans)
        backward_weight(work, True, Pairing(pending, i < m - 1, stats) if pairs else None)
    return [p.grad.clone() for p in params], stats, dict(pending)


@pytest.mark.parametrize("m, gemms, stats", [
    # per Linear: mb 0 finds .grad None and waits (fusion alone takes autograd's path there), mb 1 runs the pair
    # as torch.mm making .grad (K=8); m=4: mb 2 waits, mb 3 (the stage's last W) runs the pair as addmm_ (K=8):
    # 2 GEMMs per Linear, 4 in all (fusion alone: 3 addmm_ per Linear, 6)
    (4, [8, 8, 8, 8], {"deferred": 4, "paired": 4, "apart": 0, "alone": 0, "leftover": 0, "flushed": 0}),
    # m=3: the pair (mm, K=8), then mb 2, the last, alone (addmm_, K=4) (fusion alone: 4)
    (3, [8, 8, 4, 4], {"deferred": 2, "paired": 2, "apart": 0, "alone": 2, "leftover": 0, "flushed": 0}),
    # m=5: pairs at mb 1 and 3, mb 4 alone: 3 per Linear (fusion alone: 8)
    (5, [8, 8, 8, 8, 4, 4], {"deferred": 4, "paired": 4, "apart": 0, "alone": 2, "leftover": 0, "flushed": 0}),
    # m=2: one pair, making .grad (fusion alone: 2)
    (2, [8, 8], {"deferred": 2, "paired": 2, "apart": 0, "alone": 0, "leftover": 0, "flushed": 0}),
], ids=["m4", "m3", "m5", "m2"])
def test_gemm_count_and_rows(addmm_calls, m, gemms, stats):
    paired, got, pending = _grads(m, True)
    assert sorted(addmm_calls, reverse=True) == gemms
    assert got.as_dict() == stats and pending == {}
    addmm_calls.clear()
    alone, _, _ = _grads(m, False)
    assert len(addmm_calls) == 2 * (m - 1)
    for a, b in zip(alone, paired):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_unlike_operands_run_apart():
    """A pending pair whose operands differ in contiguity from the new one: two addmm_, same sum."""
    g = torch.Generator().manual_seed(3)
    weight = nn.Parameter(torch.randn(5, 6, generator=g))
    weight.grad = torch.randn(5, 6, generator=g)
    start = weight.grad.clone()
    g1, x1 = torch.randn(4, 5, generator=g), torch.randn(4, 6, generator=g)
    g2, x2 = torch.randn(4, 5, generator=g), torch.randn(6, 4, generator=g).t()  # column-major left
    pending, stats = {}, PairStats()
    with torch.no_grad():
        Pairing(pending, True, stats).gemm(weight, g1, x1)
        assert list(pending) == [id(weight)] and torch.equal(weight.grad, start)  # kept, not run
        Pairing(pending, True, stats).gemm(weight, g2, x2)
    assert pending == {} and stats.as_dict() == {"deferred": 1, "paired": 0, "apart": 1, "alone": 0, "leftover": 0,
                                                 "flushed": 0}
    torch.testing.assert_close(weight.grad, start + g1.t() @ x1 + g2.t() @ x2, rtol=1e-6, atol=1e-6)


def test_a_pending_pair_the_next_w_declines_runs_at_the_stages_last_w():
    """m=4; before the last W a hook goes on the first Linear's weight, so that W declines fusion (autograd's
    path) and leaves the pending pair: the stage's last W runs it (the executor's ``leftover``), sums unchanged."""
    results = []
    for pairs in (False, True):
        stage = _stage()
        stage.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(0)
        plans, params = SplitPlans(), list(stage.parameters())
        pending, stats = {}, PairStats()
        for i in range(4):
            if i == 3:
                stage[0].weight.register_post_accumulate_grad_hook(lambda p: None)
            x = torch.randn(4, 8, generator=g).requires_grad_()
            y = stage(x)
            _, work = backward_input([y], [torch.randn(y.shape, generator=g)], [x], params, plans)
            backward_weight(work, True, Pairing(pending, i < 3, stats) if pairs else None)
        if pairs:
            assert list(pending) == [id(stage[0].weight)]
            assert run_pending(pending) == 1 and pending == {}
            assert stats.as_dict() == {"deferred": 4, "paired": 3, "apart": 0, "alone": 0, "leftover": 0,
                                       "flushed": 0}
        results.append([p.grad.clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_run_pending_runs_and_clears():
    weight = nn.Parameter(torch.zeros(2, 3))
    weight.grad = torch.zeros(2, 3)
    pending = {id(weight): (weight, torch.ones(4, 2), torch.ones(4, 3))}
    assert run_pending(pending) == 1 and pending == {}
    assert torch.equal(weight.grad, torch.full((2, 3), 4.0))


@pytest.mark.parametrize("schedule, v", [("zbv", 2), ("zb-h1", 1), ("zb-h2", 1), ("dualpipev", 2), ("1f1b", 1),
                                         ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("m", [3, 4, 8])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_stages_last_weight_grad_never_waits(schedule, v, m, dp):
    """The stream rule, on the compiled programs (W, or B: run as I then W under fusion, for 1f1b and interleaved):
    per rank and stage, every W (or B) but the last in the stream may wait, and the stage's ALL_REDUCE (dp > 1)
    and any TIE_REDUCE come after that last one."""
    if schedule == "dualpipev" and m < 4:
        pytest.skip("dualpipev needs m >= 2p")
    program = pipesched.compile_program(schedule, 2, m, virtual_stages=v, dp_size=dp)
    for stream in program.ranks:
        later = later_weight_grads(stream)
        last = {}
        for at, instr in enumerate(stream):
            if instr.op in (Op.W, Op.B):
                last[instr.stage] = at
        assert last, "every rank has a weight-gradient instruction"
        for at, instr in enumerate(stream):
            if instr.op in (Op.W, Op.B):
                assert ((instr.stage, instr.microbatch) in later) is (at != last[instr.stage]), (instr, at)
            if instr.op is Op.ALL_REDUCE:
                assert at > last[instr.stage], instr
            if instr.op is Op.TIE_REDUCE:
                assert at > max(last.values()), instr
        if dp > 1:
            assert {i.stage for i in stream if i.op is Op.ALL_REDUCE} == set(last)
        assert len(later) == sum(1 for i in stream if i.op in (Op.W, Op.B)) - len(last)


NONE = {"deferred": 0, "paired": 0, "apart": 0, "alone": 0, "leftover": 0, "flushed": 0}


def _expected(split_stages, linears, m, steps=3):
    """PairStats of ``steps`` steps: per split stage's Linear (the first W finds .grad None: its pair makes it):
    m=4: wait, pair, wait, pair; m=3: wait, pair, alone."""
    k = split_stages * linears * steps
    per = {4: {"deferred": 2, "paired": 2, "alone": 0}, 3: {"deferred": 1, "paired": 1, "alone": 1}}[m]
    return {**NONE, **{name: count * k for name, count in per.items()}}


def _check_case(case, expected, ops=("I", "W")):
    for step in case["steps"]:
        assert step["grads"] > 0 and step["close_ref"] and step["close_fused"], step
        assert step["worst_ref"] < 1e-6 and step["worst_fused"] < 1e-6, step
    assert case["stats"]["flushed"] == 0, case["stats"]  # the step's-end safety net never had work
    assert case["stats"] == expected, (case["stats"], expected)
    assert case["fused_stats"] == NONE  # pairing off: never asked
    assert set(ops) <= set(case["ops"]) and ("B" in case["ops"]) is ("B" in ops), case["ops"]


@pytest.mark.multiprocess
def test_pipeline_with_pairs_matches_the_unsplit_model_and_fusion_alone():
    results = launch(rt.suite, 2, timeout=240, start_method="fork")
    for rank, got in enumerate(results):
        # zbv: 8 Linears in 4 stages of 2; rank 0 holds stages 0 (its W is the whole backward: nothing fused) and 3,
        # rank 1 stages 1 and 2. zb-h1: rank 0 holds stage 0 only, rank 1 stage 1 with 4 Linears
        for m in (4, 3):
            _check_case(got[f"zbv-m{m}"], _expected((1, 2)[rank], 2, m))
            _check_case(got[f"zb-h1-m{m}"], NONE if rank == 0 else _expected(1, 4, m))
        _check_case(got["zbv-recompute"], _expected((1, 2)[rank], 2, 4), ops=("I", "W", "R"))
        _check_case(got["1f1b"], NONE if rank == 0 else _expected(1, 4, 4), ops=("B",))  # the same stages as zb-h1
        need = ("ValueError", "Pipeline: pair_weight_grads=True needs gradient_accumulation_fusion=True (it pairs the "
                "fused weight-gradient GEMMs), got gradient_accumulation_fusion=False: pass both True, or "
                "pair_weight_grads=False")
        assert got["no-fusion"] == got["fusion-false"] == need
        assert got["not-bool"] == ("TypeError", "Pipeline: pair_weight_grads must be True or False, got str 'yes'")
        assert got["int"] == ("TypeError", "Pipeline: pair_weight_grads must be True or False, got int 1")


@pytest.mark.multiprocess
def test_pipeline_with_pairs_and_data_parallelism():
    results = launch(rt.replicated, 4, timeout=240, start_method="fork")
    assert sorted(case["split_stages"] for case in results) == [1, 1, 2, 2]  # two replicas of the 2-rank zbv
    for case in results:
        _check_case(case, _expected(case["split_stages"], 2, 4))


@pytest.mark.multiprocess
def test_zb_auto_with_measured_costs_keeps_pairing_after_its_executor_is_rebuilt():
    # step 1 measures the costs with a safe program, then measured_costs.rebuilt_executor compiles zb-auto from them
    # and makes a new executor: it once lost pair_weight_grads there (a RankWork rebuilt field by field)
    results = launch(rt.measured_zb_auto, 2, timeout=240, start_method="fork")
    assert [case["pairing"] for case in results] == [True, True]
    for case in results:
        assert all(step["close_ref"] and step["close_fused"] for step in case["steps"]), case["steps"]
        assert case["stats"]["flushed"] == 0, case["stats"]
    assert results[1]["stats"]["paired"] > 0, results[1]["stats"]  # rank 1's stage (Linears after stage 0) pairs
