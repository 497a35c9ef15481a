"""With data parallelism a step refused on one replica is refused on every replica (a ValueError each, the
pipeline usable), so the next step's all-reduce averages the same step on every replica (the unsplit model's
average over replicas, rtol 1e-5). Before: the other replica ran the step, and its all-reduce met the refusing
replica's next step, silently averaging gradients of different steps from then on."""
import pytest

from pipesched.runtime import launch

import rt_dp_refusal


@pytest.fixture(scope="module")
def got():
    return launch(rt_dp_refusal.refusals, 4, timeout=300)


def test_every_replica_refuses_what_one_refuses(got):
    for out in got:
        errors = out["errors"]
        prefix = "replica 1 refused its step: " if out["replica"] == 0 else ""
        for case, text in (("small batch", "batch size 2 is smaller than num_microbatches=4"),
                           ("bad target", "target has batch size 3 but x has 8")):
            assert errors[case].startswith(prefix) and text in errors[case], (case, errors[case])
            assert out["replica"] == 0 or not errors[case].startswith("replica")  # its own message
        pp_rank = out["pp_rank"]  # the call is compared in this pipeline position's data-parallel group (2 ranks)
        assert errors["forward"] == (f"every replica must make the same call; replica 0 (world rank {pp_rank}) "
                                     f"called step(), replica 1 (world rank {2 + pp_rank}) called forward()"), errors
        # each replica's pipeline ranks agree (its opening passed), the replicas do not: their gradients would be
        # averaged across two precisions (it ran, before)
        assert errors["autocast"] == ("step() was called under different autocast settings: replica 0 without "
                                      "autocast, replica 1 under torch.autocast('cpu', dtype=torch.bfloat16); enter "
                                      "the same torch.autocast on every rank, or pass autocast= to Pipeline (then "
                                      "the caller's is ignored)"), errors


def test_the_next_step_averages_the_same_step_on_every_replica(got):
    for out in got:
        assert out["grads"] and all(out["grads"].values()), out["grads"]
