"""The step's lead (pipesched/runtime/lead.py): stage 0's rank runs its first forward while the step's opening
all-gather is in flight. A refused step leaves no trace of it (RNG restored: the same losses, gradients and
generator state as a run without that step); an error of that forward ends every rank naming F0.0, unless the
step is refused, which wins; no lead runs where it could not be undone (buffers, hooks, a forward writing its
input)."""
import pytest

from pipesched.runtime import launch

import rt_lead


@pytest.fixture(scope="module")
def refusal():
    return launch(rt_lead.refusal, 2, timeout=300)


def test_a_refused_step_after_its_lead_leaves_no_trace(refusal):
    for rank, runs in enumerate(refusal):
        assert runs["with"]["loss"] == runs["without"]["loss"]
        assert runs["with"]["grads"] == runs["without"]["grads"]
        assert runs["with"]["rng"] == runs["without"]["rng"]
        assert "target has batch size 3 but x has 4" in runs["with"]["error"]
    assert (refusal[0]["with"]["leads"], refusal[0]["without"]["leads"]) == (2, 1)  # steps 2, 3 / step 3
    assert (refusal[1]["with"]["leads"], refusal[1]["without"]["leads"]) == (0, 0)  # only stage 0's rank leads


def test_the_leads_error_ends_every_rank_unless_the_step_is_refused():
    got = launch(rt_lead.lead_error, 2, timeout=300)
    for rank, out in enumerate(got):
        assert "F0.0" in out["failed"] and "planted" in out["failed"], out["failed"]
        assert "pipeline rank 0" in out["failed"] or "rank 0" in out["failed"]
        assert "target has batch size 3 but x has 4" in out["refused"]
        assert isinstance(out["after"], float)
    assert [out["leads"] for out in got] == [1, 0]


def test_no_lead_where_it_could_not_be_undone():
    got = launch(rt_lead.no_lead, 2, timeout=300)
    assert got[0] == {"buffers": (0, 0), "hook": (0, 0), "writes input": (0, 0), "plain": (2, 1),
                      "global hook": (0, 0)}
    assert got[1] == {"buffers": (0, 0), "hook": (0, 0), "writes input": (0, 0), "plain": (0, 0),
                      "global hook": (0, 0)}


def test_forward_with_a_lead_equals_the_unsplit_model():
    got = launch(rt_lead.forward_outputs, 2, timeout=300)
    assert got[0] == {"leads": 1, "equal": [None, None]}  # stage 0's rank returns no output
    assert got[1] == {"leads": 0, "equal": [True, True]}
