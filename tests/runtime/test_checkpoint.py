"""Checkpoints (pipesched.runtime.checkpoint): unsplit-model names, exact resume in new processes (1f1b and
interleaved-1f1b, dropout, AdamW), resharding 4 -> 2 ranks, loading into the plain model in this process, bad
checkpoints and arguments (the same error on every rank, nothing loaded), and a rank killed during a save."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from pipesched.runtime import latest_checkpoint, launch, load_into

import rt_checkpoint
from rt_tied import tied_model
from rt_checkpoint import STEPS, buffered_model

SCHEDULES = ("1f1b", "interleaved-1f1b")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the raw DCP calls below


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(root / "foreign"), no_dist=True)  # DCP, not ours
    (root / "incomplete").mkdir()
    (root / "incomplete" / "__0_0.distcp").write_bytes(b"half a shard")
    first = launch(rt_checkpoint.first_run, 4, str(root), timeout=400)
    resumed = launch(rt_checkpoint.resumed_run, 4, str(root), timeout=300)
    two = launch(rt_checkpoint.two_rank_run, 2, str(root), timeout=300)
    with pytest.raises(Exception) as crash:
        launch(rt_checkpoint.crash_run, 2, str(root), timeout=200, grace=10)
    return {"root": root, "first": first, "resumed": resumed, "two": two, "crash": crash.value}


def merged(states):
    """One {name: tensor} from every rank's state dict (names of a rank appear on that rank only)."""
    out = {}
    for state in states:
        out.update(state)
    return out


def assert_bitwise(a: dict, b: dict):
    assert list(a) == list(b) or sorted(a) == sorted(b), (sorted(a), sorted(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_state_dict_names_are_the_unsplit_models(runs):
    names = [res["names"] for res in runs["first"]]  # 1f1b on 4 ranks, 2 layers per stage
    assert names == [["0.weight", "0.bias"],
                     ["2.weight", "2.bias", "2.running_mean", "2.running_var", "2.num_batches_tracked",
                      "3.weight", "3.bias"],
                     ["5.weight", "5.bias"],
                     ["7.weight", "7.bias"]]
    assert sum(names, []) == list(buffered_model(0).state_dict())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resume_in_new_processes_is_bitwise_the_straight_run(runs, schedule):
    # 2k steps straight == k steps, save, 4 new processes (other init, other seed), load, k steps: AdamW + dropout
    for rank in range(4):
        straight = runs["first"][rank][("straight", schedule)]
        half = runs["first"][rank][("half", schedule)]
        resumed = runs["resumed"][rank][schedule]
        assert half == straight["losses"][:STEPS]
        assert resumed["losses"] == straight["losses"][STEPS:], (rank, resumed["losses"], straight["losses"])
        assert_bitwise(resumed["state"], straight["state"])
        assert resumed["info"] == (STEPS, {"schedule": schedule, "pair": [1, 2], "t": [0, 1, 2]}, True)
    assert len(set(runs["first"][0][("straight", schedule)]["losses"])) == 2 * STEPS  # the loss moves


def test_a_4_rank_checkpoint_loads_on_2_ranks_with_another_balance(runs):
    four, two = runs["first"], runs["two"]
    assert_bitwise(merged(r["reshard"]["loaded"] for r in two), merged(r["at_save"] for r in four))
    for r in two:
        assert r["reshard"]["info"] == (STEPS, None, False)  # another layout: RNG states not restored
        assert r["reshard"]["next_loss"] == four[0]["next_loss"]  # the same next loss, bitwise
    assert_bitwise(merged(r["reshard"]["after_next"] for r in two), merged(r["after_next"] for r in four))


def test_a_data_parallel_checkpoint_loads_on_4_pipeline_ranks(runs):
    saved = [r["dp_saved"] for r in runs["first"]]  # world ranks 0, 1: replica 0; 2, 3: replica 1
    for rank in (0, 1):
        assert_bitwise(saved[rank], saved[rank + 2])  # the replicas agree, so one copy of each name is enough
    entries = FileSystemReader(str(runs["root"] / "dp")).read_metadata().state_dict_metadata
    assert sorted(n for n in entries if n.startswith("model.")) == sorted(f"model.{n}" for n in merged(saved[:2]))
    loaded = [r["from_dp"] for r in runs["resumed"]]
    assert_bitwise(merged(r["loaded"] for r in loaded), merged(saved[:2]))
    assert [r["rng_restored"] for r in loaded] == [False] * 4  # 2 x 2 -> 4 x 1: another layout


def test_load_into_the_plain_model_in_one_process(runs):
    path = runs["root"] / "reshard"
    saved = merged(r["at_save"] for r in runs["first"])
    model = buffered_model(9)
    info = load_into(model, path)
    assert (info.step, info.extra, info.rng_restored) == (STEPS, None, False)
    assert_bitwise(model.state_dict(), saved)
    plain = buffered_model(9)  # DCP's own call, as the README shows it
    dcp.load({"model": plain.state_dict()}, checkpoint_id=str(path), no_dist=True)
    assert_bitwise(plain.state_dict(), saved)
    wrong = buffered_model(9, layers=9)
    with pytest.raises(ValueError, match=r"has no entry for '8.weight' \(shape \(8, 8\)\)"):
        load_into(wrong, path)
    assert_bitwise(wrong.state_dict(), buffered_model(9, layers=9).state_dict())  # nothing loaded


def test_a_checkpoint_of_another_model_is_the_same_error_on_every_rank_and_loads_nothing(runs):
    path = str(runs["root"] / "reshard")
    expect = {
        "missing": f"checkpoint {path!r} has no entry for '8.weight' (shape (8, 8)), which this model has",
        "extra": f"checkpoint {path!r} has '7.weight', which this model does not have (it has 11 names",
        "shape": f"'5.weight' has shape (8, 8) in checkpoint {path!r} but shape (8, 4) in this model",
        "sgd": f"checkpoint {path!r} has no optimizer hyperparameter 'momentum' for parameter '0.weight'",
    }
    for case, text in expect.items():
        errors = [r[case] for r in runs["two"]]
        for (kind, message), unchanged in errors:
            assert kind == "ValueError" and text in message, (case, message)
            assert unchanged, case
        assert errors[0] == errors[1], case


def test_missing_foreign_or_incomplete_directories_are_clear_errors_naming_the_path(runs):
    root = runs["root"]
    expect = {"nope": ("FileNotFoundError", f"checkpoint {str(root / 'nope')!r} does not exist"),
              "foreign": ("ValueError", f"checkpoint {str(root / 'foreign')!r} is not a pipesched checkpoint"),
              "incomplete": ("ValueError", f"checkpoint {str(root / 'incomplete')!r} is incomplete or not a "
                                           f"checkpoint: it has no .metadata")}
    for case, (kind, text) in expect.items():
        for (got_kind, message), unchanged in (r[case] for r in runs["two"]):
            assert got_kind == kind and message.startswith(text), (case, message)
            assert unchanged


def test_bad_save_arguments_or_a_failed_write_are_the_same_error_on_every_rank_and_save_nothing(runs):
    root = runs["root"]
    for r in runs["two"]:
        assert r["bad_step"] == ("ValueError", "step must be None or an int >= 0, got -1")
        assert r["bad_extra"][0] == "TypeError" and r["bad_extra"][1].startswith(
            "extra must be JSON-serialisable (dict, list, str, int, float, bool, None), or a dict whose top-level "
            "values may also be tensors; got {'a': {1, 2}}")
        assert r["paths_differ"] == ("ValueError", f"save_checkpoint: world rank 1 gave path="
                                     f"{str(root / 's3-rank1')!r} but world rank 0 path={str(root / 's3-rank0')!r}; "
                                     f"every rank must pass the same path")
        assert r["not_a_checkpoint"] == ("FileExistsError", f"path {str(root / 'foreign')!r} exists and is not a "
                                         f"pipesched checkpoint; refusing to replace it (save elsewhere or remove it)")
        assert r["write_fails"] == ("RuntimeError", f"checkpoint {str(root / 's4')!r}: ranks failed while writing it "
                                                    f"(rank 1: OSError: No space left on device (simulated))")
        assert r["saved_nothing"] == []


def test_pipeline_load_state_dict_takes_an_unsplit_state_dict(runs):
    for r in runs["two"]:
        keys, equal = r["load_state_dict"]
        assert (keys.missing_keys, keys.unexpected_keys, equal) == ([], [], True)
    # a local call: rank 0 (layers 0-3) lacks '0.bias', rank 1 (layers 4-7) has all it needs
    assert runs["two"][0]["strict"] == ("ValueError", "the state dict has no entry for '0.bias' (shape (8,)), which "
                                        "pipeline rank 0 needs for its stage 0 (layer 0's '0.bias'): a state dict "
                                        "must hold every tensor of the rank that loads it (the unsplit model's "
                                        "state_dict(), or this rank's own Pipeline.state_dict()); strict=False "
                                        "skips the missing ones")
    assert runs["two"][1]["strict"] is None


def test_a_tied_weight_is_stored_once_and_fills_every_copy(runs):
    # rt_tied.tied_model on 2 ranks (layers 0-3 | 4-6): 0.weight = 6.weight (embedding = head), 1 = 3 = 5.weight
    saved, loaded = [r["tied"]["saved"] for r in runs["two"]], [r["tied"]["loaded"] for r in runs["two"]]
    # each rank's state_dict() holds every tensor it has, a tied copy under the tie's first name (DCP writes it once)
    assert [s["names"] for s in saved] == [["0.weight", "1.weight", "1.bias", "3.bias"], ["0.weight", "1.weight",
                                                                                           "5.bias"]]
    entries = FileSystemReader(str(runs["root"] / "tied")).read_metadata().state_dict_metadata
    assert sorted(n for n in entries if n.startswith("model.")) == [
        "model.0.weight", "model.1.bias", "model.1.weight", "model.3.bias", "model.5.bias"]
    assert not [n for n in entries if n.startswith(("optim.state.6.", "optim.state.3.weight", "optim.state.5.weight"))]
    for rank in range(2):
        assert_bitwise(loaded[rank]["uses"], saved[rank]["uses"])  # the copy on rank 1 too (5.weight, 6.weight)
        assert loaded[rank]["next_loss"] == saved[rank]["next_loss"]
        assert_bitwise(loaded[rank]["after_next"], saved[rank]["after_next"])  # its AdamW state was loaded too
    assert torch.equal(saved[1]["after_next"]["6.weight"], saved[0]["after_next"]["0.weight"])
    plain = tied_model(5)
    load_into(plain, runs["root"] / "tied")
    assert plain[6].weight is plain[0].weight and torch.equal(plain[0].weight, saved[0]["uses"]["0.weight"])


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_latest(runs):
    folder = runs["root"] / "crash"
    assert "killed by signal 9" in str(runs["crash"]) or "rank 0" in str(runs["crash"])
    assert not (folder / "step-000002").exists()
    assert latest_checkpoint(folder) == str(folder / "step-000001")
    assert load_into(buffered_model(0), folder / "step-000001").extra == "replaced"  # the second save replaced it
    temp = folder / ".step-000002.saving"
    assert temp.is_dir()  # what the killed save left: refused, and skipped by latest_checkpoint
    with pytest.raises(ValueError, match="is the temporary directory of a save that did not finish"):
        load_into(buffered_model(0), temp)
    assert sorted(os.listdir(folder)) == [".step-000002.saving", "step-000001"]
    assert latest_checkpoint(runs["root"] / "nowhere") is None
