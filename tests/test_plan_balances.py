"""The planner simulates more than one cut per placement with several stages per rank: balance_by_time's two
ties and the cut of least slowest stage, next to the even one; the simulation picks."""
import pytest

from pipesched.partition import balance_by_time
from pipesched.placement import looped
from pipesched.planner import plan, predict
from pipesched.profile import LayerProfile

MiB = 2**20


def gpt_like(layers=96):
    """An embedding of 3 units, blocks of 1, a head of 4 (ms per sample, F = I = W); 100 MiB of parameters per
    layer, so that with 6 GiB per rank only 8 pipeline ranks hold the model (4 x 12 layers x 100 MiB = 4.7 GiB)."""
    ms = [3e-3] + [1e-3] * (layers - 2) + [4e-3]
    return LayerProfile(forward=ms, input_grad=ms, weight_grad=ms, activation_bytes=[MiB] * layers,
                        output_bytes=[MiB] * layers, param_bytes=[100 * MiB] * layers, microbatch_size=1,
                        layer_names=["Block"] * layers)


def test_the_even_tie_wins_where_it_simulates_faster():
    profile = gpt_like()
    result = plan(profile, 8, 6 * 2**30, 8, schedules=["interleaved-1f1b"], virtual_stages=(4,), top=1)
    best = result.best
    seconds = profile.layer_seconds()
    even_tie = balance_by_time(seconds, 32, looped(8, 4), ties="even")
    first_tie = balance_by_time(seconds, 32, looped(8, 4))
    assert (best.pp, best.virtual_stages, best.num_microbatches) == (8, 4, 8)
    assert even_tie != first_tie and best.balance == even_tie
    # what it beat: the same configuration with the first tie, simulated as the planner does
    other = predict(profile, 8, "interleaved-1f1b", 8, 1, 8, 4, balance=first_tie, split_backward=best.split_backward)
    assert (best.step_time, other.step_time) == (pytest.approx(0.362), pytest.approx(0.405))  # seconds
