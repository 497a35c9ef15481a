"""Session 11's message fixes (torch-free): a compute-only deadlock names what a blocked rank waits for, cost errors
say the unit of their field, the demo's depth error is singular where it should be, and README's Pipeline(...)
block lists every argument of the constructor."""
import ast
import re
from pathlib import Path

import pytest

import pipesched as ps
from pipesched.cost import CostError, CostModel
from pipesched.demo.options import options
from pipesched.errors import DeadlockError
from pipesched.profile import LayerProfile

ROOT = Path(__file__).resolve().parents[1]


# ---- 2. a deadlock names the awaited instruction and its rank ----------------------------------------------------

def test_compute_only_deadlock_names_the_awaited_instruction_and_rank():
    program = ps.loads("microbatches: 2\nstage_to_rank: 0 1\nrank 0: F0.0 B0.0 F0.1 B0.1\n"
                       "rank 1: F1.1 F1.0 B1.0 B1.1\n")
    with pytest.raises(DeadlockError) as info:
        ps.validate(program)
    lines = str(info.value).splitlines()
    assert lines[:3] == ["rank 0, B0.0: deadlock: no rank can make progress and work remains",
                         "  rank 0 blocked at B0.0 (step 1): waiting for B1.0 on rank 1",
                         "  rank 1 blocked at F1.1 (step 0): waiting for F0.1 on rank 0"]


def test_three_rank_deadlock_names_each_awaited_instruction():
    program = ps.loads("microbatches: 2\nstage_to_rank: 0 1 2\nrank 0: F0.0 F0.1 B0.0 B0.1\n"
                       "rank 1: F1.0 B1.0 F1.1 B1.1\nrank 2: F2.1 F2.0 B2.0 B2.1\n")
    with pytest.raises(DeadlockError) as info:
        ps.validate(program)
    assert str(info.value).splitlines()[1:4] == ["  rank 0 blocked at B0.0 (step 2): waiting for B1.0 on rank 1",
                                                 "  rank 1 blocked at B1.0 (step 1): waiting for B2.0 on rank 2",
                                                 "  rank 2 blocked at F2.1 (step 0): waiting for F1.1 on rank 1"]


# ---- 3. cost errors say the unit of their field ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"forward": -1}, "cost forward must be a finite number >= 0 (seconds), got -1"),
    ({"weight_grad": [1, float("nan")]}, "cost weight_grad must be a finite number >= 0 (seconds), got nan"),
    ({"latency": -1}, "cost latency must be a finite number >= 0 (seconds), got -1"),
    ({"send_overhead": float("inf")}, "cost send_overhead must be a finite number >= 0 (seconds), got inf"),
    ({"activation_bytes": -4}, "cost activation_bytes must be a finite number >= 0 (bytes), got -4"),
    ({"grad_bytes": [1, -2]}, "cost grad_bytes must be a finite number >= 0 (bytes), got -2"),
    ({"stash_bytes": float("inf")}, "cost stash_bytes must be a finite number >= 0 (bytes), got inf"),
    ({"tie_bytes": -1.5}, "cost tie_bytes must be a finite number >= 0 (bytes), got -1.5"),
])
def test_cost_errors_say_the_unit_of_their_field(kwargs, message):
    with pytest.raises(CostError) as info:
        CostModel(**kwargs)
    assert str(info.value) == message


def test_a_cost_given_none_says_its_unit():
    with pytest.raises(CostError) as info:
        CostModel(latency=None)
    assert str(info.value).startswith("cost latency must be a finite number >= 0 (seconds), got None (only ")
    with pytest.raises(CostError) as info:
        CostModel(activation_bytes=None)
    assert str(info.value).startswith("cost activation_bytes must be a finite number >= 0 (bytes), got None (only ")


_PROFILE = dict(forward=(1.0, 1.0), input_grad=(1.0, 1.0), weight_grad=(0.0, 0.0), activation_bytes=(8, 8),
                output_bytes=(4, 4), param_bytes=(0, 0), microbatch_size=1)


@pytest.mark.parametrize("change, message", [
    ({"forward": (1.0, -1.0)}, "LayerProfile.forward[1] must be a finite number >= 0 (seconds), got -1.0"),
    ({"output_bytes": (4, -4)}, "LayerProfile.output_bytes[1] must be a finite number >= 0 (bytes), got -4"),
    ({"input_bytes": -1}, "LayerProfile.input_bytes must be a finite number >= 0 (bytes), got -1"),
    ({"latency": -0.5}, "LayerProfile.latency must be a finite number >= 0 (seconds), got -0.5"),
    ({"send_overhead": float("nan")}, "LayerProfile.send_overhead must be a finite number >= 0 (seconds), got nan"),
    ({"forward_fixed": (-0.1, 0.0)}, "LayerProfile.forward_fixed[0] must be a finite number >= 0 (seconds), got -0.1"),
    ({"boundary_saves": ((1, 1, ((1, -1.0),)),)},
     "LayerProfile.boundary_saves[0] bytes of layer 1 must be a finite number >= 0 (bytes), got -1.0"),
])
def test_profile_errors_say_the_unit_of_their_field(change, message):
    with pytest.raises(ValueError) as info:
        LayerProfile(**{**_PROFILE, **change})
    assert str(info.value) == message


def test_the_cli_says_the_unit_too(capsys):
    from pipesched.cli import main
    code = main(["simulate", "1f1b", "--ranks", "2", "--microbatches", "2", "--latency", "-1"])
    err = capsys.readouterr().err
    assert code != 0 and "cost latency must be a finite number >= 0 (seconds), got -1" in err, err


# ---- 4. the demo's depth error: singular where it should be ---------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--depth", "1", "--ranks", "5"],
     "--depth 1 gives the model 4 layers (embedding, 1 block, final norm, head) but 5 ranks x 1 virtual stage = 5 "
     "stages need at least 5: use --depth 2 or more (or leave --depth out), or fewer --ranks or --virtual-stages"),
    (["--schedule", "interleaved-1f1b", "--depth", "1", "--ranks", "1", "--virtual-stages", "6"],
     "--depth 1 gives the model 4 layers (embedding, 1 block, final norm, head) but 1 rank x 6 virtual stages = 6 "
     "stages need at least 6: use --depth 3 or more (or leave --depth out), or fewer --ranks or --virtual-stages"),
    (["--schedule", "interleaved-1f1b", "--depth", "2"],
     "--depth 2 gives the model 5 layers (embedding, 2 blocks, final norm, head) but 4 ranks x 2 virtual stages = 8 "
     "stages need at least 8: use --depth 5 or more (or leave --depth out), or fewer --ranks or --virtual-stages"),
])
def test_demo_depth_error_grammar(argv, message, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        options(argv, prog="demo")
    assert capsys.readouterr().err.splitlines()[-1] == f"demo: error: {message}"


# ---- 5. README's Pipeline(...) block and the tied-weights text --------------------------------------------------

def _init_params() -> list[str]:
    tree = ast.parse((ROOT / "pipesched" / "runtime" / "pipeline.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]


def test_readme_pipeline_block_lists_every_constructor_argument():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("pipe = Pipeline(model,                      # nn.Sequential")
    block = readme[start:readme.index("\nopt = ", start)]
    named = [name for line in block.splitlines() for name in re.findall(r"(\w+)=", line.split("#")[0])]
    assert ["model", *named] == _init_params()
    assert "                profile=None,               # balance=\"time\" only" in block
    assert "                pair_weight_grads=False)    # True (with fusion)" in block  # the last argument
    assert "(no ties= argument: tied weights are found in the model, see below)" in block
    assert "ties" not in _init_params()


def test_readme_says_ties_are_found_without_an_argument():
    readme = (ROOT / "README.md").read_text()
    assert ("- **Tied weights** (`head.weight = embedding.weight`, first and last stage). `Pipeline` finds the ties "
            "itself\n  (it has no `ties=` argument; `ties=` is `compile_program`'s, and `--ties` the command "
            "line's): every\n  parameter used by two stages or more,") in readme
    src = (ROOT / "pipesched" / "api.py").read_text() + (ROOT / "pipesched" / "cli.py").read_text()
    assert "def compile_program(" in src and '"--ties"' in src
