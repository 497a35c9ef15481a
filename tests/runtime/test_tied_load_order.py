"""load_state_dict with a tied parameter's names holding different values (a state dict from an untied source):
every copy takes the last name's value in model order, as nn.Module.load_state_dict leaves it."""
import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline, launch

import rt_tied


def body(rank):
    torch.set_num_threads(1)
    pipe = Pipeline(rt_tied.tied_model(), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[4, 3])
    state = {k: v.clone() for k, v in rt_tied.tied_model().state_dict().items()}
    state["6.weight"] = state["6.weight"] + 1.0  # the head's name (later than the embedding's 0.weight)
    plain = rt_tied.tied_model()
    plain.load_state_dict(state)
    pipe.load_state_dict(state)
    mine = pipe.state_dict()["0.weight"]  # the tie's stored name, on both ranks
    out = (torch.equal(mine, state["6.weight"]), torch.equal(plain.get_parameter("0.weight"), state["6.weight"]))
    pipe.close()
    return out


def test_the_last_name_of_a_tie_wins_as_in_torch():
    assert launch(body, 2, timeout=120) == [(True, True), (True, True)]
