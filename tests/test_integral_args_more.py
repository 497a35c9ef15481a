"""More integer-like arguments: numpy integers are accepted where an integer is, and become plain ints at once, by
the partition functions (``num_stages``, ``max_nodes``, ``stage_to_rank``), LayerProfile (``microbatch_size``,
``scaled``, ``costs``'s balance), ``from_torch_csv`` (sizes, ``stage_to_rank``) and a Candidate built directly (so
its JSON form dumps). A bool is still refused with the existing message. Torch-free."""
import json
import warnings

import pytest

import pipesched as ps
from pipesched.interop import TorchCsvWarning, from_torch_csv
from pipesched.partition import balance_by_time, rank_loads
from pipesched.planner import Candidate
from pipesched.profile import LayerProfile

np = pytest.importorskip("numpy")

I = np.int64


def plain(values):
    return all(type(v) is int for v in values)


# ---- partition --------------------------------------------------------------------------------------------------

def test_balance_by_time_takes_numpy_sizes_and_gives_ints():
    costs = [1, 2, 3, 4, 1, 1]
    assert balance_by_time(costs, 2) == (3, 3)
    got = balance_by_time(costs, I(2), max_nodes=I(1000))
    assert got == (3, 3) and plain(got)
    looped = balance_by_time(costs, I(4), stage_to_rank=(I(0), I(1), I(0), I(1)), max_nodes=I(1000))
    assert looped == balance_by_time(costs, 4, stage_to_rank=(0, 1, 0, 1), max_nodes=1000) and plain(looped)
    assert rank_loads(costs, [I(3), I(3)]) == (6, 6)
    assert rank_loads(costs, np.array([2, 1, 2, 1]), (I(0), I(1), I(0), I(1))) == (8, 4)


def test_balance_by_time_still_refuses_bools():
    with pytest.raises(TypeError, match="num_stages must be an int, got True"):
        balance_by_time([1, 1], True)
    with pytest.raises(ValueError, match="max_nodes must be None or an int >= 1, got True"):
        balance_by_time([1, 1], 2, max_nodes=True)
    with pytest.raises(ValueError, match=r"stage_to_rank=\[0, True\] must give a rank \(int >= 0\) for each of the 2"):
        balance_by_time([1, 1], 2, stage_to_rank=(0, True))


# ---- LayerProfile -----------------------------------------------------------------------------------------------

def profile(size):
    return LayerProfile(forward=[1e-3] * 4, input_grad=[1e-3] * 4, weight_grad=[1e-3] * 4,
                        activation_bytes=[100] * 4, output_bytes=[10] * 4, param_bytes=[40] * 4,
                        microbatch_size=size)


def test_layer_profile_takes_a_numpy_microbatch_size_and_balance():
    p = profile(I(2))
    assert p.microbatch_size == 2 and type(p.microbatch_size) is int
    assert json.loads(json.dumps(p.to_json()))["microbatch_size"] == 2
    assert p == profile(2)
    big = p.scaled(I(4))
    assert big.microbatch_size == 4 and type(big.microbatch_size) is int and big.activation_bytes == (200,) * 4
    assert p.costs([I(1), I(3)]) == p.costs([1, 3])
    assert p.costs(np.array([2, 2])) == p.costs((2, 2))


def test_layer_profile_still_refuses_bools():
    with pytest.raises(ValueError, match="LayerProfile.microbatch_size must be an int >= 1, got True"):
        profile(True)
    with pytest.raises(ValueError, match="microbatch_size must be an int >= 1, got True"):
        profile(2).scaled(True)
    with pytest.raises(ValueError, match=r"balance must be a sequence of layer counts >= 1, got \[True, 3\]"):
        profile(2).costs([True, 3])


# ---- from_torch_csv ---------------------------------------------------------------------------------------------

def test_from_torch_csv_takes_numpy_sizes_and_ranks(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\r\n", newline="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TorchCsvWarning)
        want = from_torch_csv(path, num_ranks=2, stage_to_rank=(0, 0), num_microbatches=2)
        got = from_torch_csv(path, num_ranks=I(2), stage_to_rank=np.array([0, 0]), num_microbatches=I(2),
                             dp_size=I(1))
    assert got == want and got.num_ranks == 2 and got.num_microbatches == 2
    assert type(got.num_microbatches) is int and type(got.dp_size) is int and plain(got.stage_to_rank)
    assert json.loads(ps.to_json(got)) == json.loads(ps.to_json(want))


def test_from_torch_csv_still_refuses_bools(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\r\n", newline="")
    with pytest.raises(ValueError, match="from_torch_csv: num_ranks must be an integer >= 1, got True"):
        from_torch_csv(path, num_ranks=True)
    with pytest.raises(ValueError, match=r"from_torch_csv: stage_to_rank=\(0, True\) must hold integer ranks"):
        from_torch_csv(path, num_ranks=2, stage_to_rank=(0, True))


# ---- Candidate ----------------------------------------------------------------------------------------------------

def candidate(**kwargs):
    fields = dict(schedule="1f1b", pp=2, dp=1, num_microbatches=4, virtual_stages=1, balance=(3, 3),
                  recompute=(False, False), split_backward=False, step_time=0.5, bubble_fraction=0.25,
                  peak_memory=(1000.0, 900.0), microbatch_size=2)
    return Candidate(**{**fields, **kwargs})


def test_a_candidate_of_numpy_integers_holds_ints_and_dumps_its_json():
    c = candidate(pp=I(2), dp=I(1), num_microbatches=I(4), virtual_stages=I(1), balance=(I(3), I(3)),
                  microbatch_size=I(2))
    assert c == candidate()
    assert plain([c.pp, c.dp, c.num_microbatches, c.virtual_stages, c.microbatch_size, *c.balance])
    text = json.dumps(c.to_json())
    assert json.loads(text) == candidate().to_json()
    assert json.loads(text)["balance"] == [3, 3] and json.loads(text)["num_microbatches"] == 4


def test_a_candidate_still_refuses_bools():
    with pytest.raises(ValueError, match="candidate field 'pp' must be an integer >= 1, got True"):
        candidate(pp=True)
