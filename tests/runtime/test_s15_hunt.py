"""Session 15's finds: what a step's bookkeeping learned at construction or at a signature's first step must
follow a setting changed later. 2 spawned gloo ranks (tests/runtime/rt_s15_hunt.py).

1. ``x.requires_grad_()`` on a later step (a caller asking for the input's gradient, e.g. for saliency) changed
   stage 0's output from not requiring grad to requiring it where stage 0 is frozen, with the same input
   signature: the step failed at stage 0's send, blaming a data-dependent output. x's ``requires_grad`` is now
   part of the signature, so the metas are re-learned.
2. ``inplace=True`` set on a stage's first layer after construction (``model[2].inplace = True``) failed with
   autograd's in-place-on-a-leaf error, although the same layer at construction is supported (the stage gets a
   copy of its input): the copy is now decided at each forward.
3. (a hunt of ranks that diverge) ``save_checkpoint``'s vote waited the whole timeout for a rank whose launch fn had
   ended; it now watches the Pipeline's failure keys.
4. (same) ``if rank == 0: save_checkpoint(...)``: rank 1's step timed out blaming itself with gloo's raw text; it
   now names the checkpoint call rank 0 was in, and rank 0's ``TimeoutError`` says the calls are collective.
5. (a silent-wrong hunt) ``recompute=True`` on a layer drawing from its own ``torch.Generator``: ``R`` drew other
   numbers than ``F`` (wrong loss and gradients); module-held generators are now replayed (and kept by
   ``profile_layers``).
6. (a new user's trial) a misspelled attribute set on a Pipeline was accepted and ignored: refused now.
7. (same) ``latest_checkpoint`` of a file or of a checkpoint itself answered None: refused now.
8. (same) a ``forward()`` input refused by stage 0's rank was called "the step input" on the other ranks.
9. (the divergent-call hunt) a failure in ``clip_grad_norm_`` or the GradScaler's vote said "(run_collective)".
10. (same) with data parallelism a rank that shares no group with a stalled rank did not name it.
11. (a new user's trial) ranks built from models of other shapes were refused naming two digests only.
12-14. (a hunt of this session's changes) a generator in the class body or a list; an emergency save after a peer
   was lost waited the whole timeout; a step's timeout named a checkpoint vote given up on long before.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, latest_checkpoint, launch, profile_layers
from pipesched.runtime.handshake import REQUIRES_GRAD, encode_signature
from pipesched.runtime.wire import DTYPE_CODE
from pipesched.runtime.model_difference import first_difference

import rt_s15_hunt


@pytest.fixture(scope="module")
def results():
    return launch(rt_s15_hunt.suite, 2, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("frozen", [False, True])
def test_input_requiring_grad_on_a_later_step(results, schedule, frozen):
    name = f"input-grad-{'frozen-' if frozen else ''}{schedule}"
    counts = [4, 2]  # this rank's parameters (frozen ones too), by rank
    for rank, res in enumerate(results):
        assert res[name] == [(True, True, counts[rank], True)] * 3, (rank, res[name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["inplace-later-1f1b", "inplace-later-zbv", "inplace-later-recompute"])
def test_inplace_set_after_construction(results, name):
    counts = [4, 2]  # zbv: rank 0 holds stages 0 and 3 (two Linears), rank 1 stages 1 and 2 (Linear, ReLU)
    for rank, res in enumerate(results):
        assert res[name] == [(True, counts[rank], True)] * 2, (rank, res[name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_recompute_replays_a_layer_s_own_generator(results, schedule):
    """5. (silenthunt) recompute=True on a layer drawing from its own torch.Generator: R drew another mask than F,
    so loss and gradients were wrong; every generator held as a module attribute is now replayed."""
    counts = [4, 4]  # two NoisyLinear layers (weight, bias) per rank
    for rank, res in enumerate(results):
        assert res[f"own-generator-{schedule}"] == [(True, counts[rank], True)] * 2, (rank, res)


@pytest.mark.multiprocess
def test_recompute_replays_a_generator_held_by_the_class_or_in_a_list(results):
    """12. (the hunt of this session's changes) a generator in the class body (``gen = torch.Generator()``) or in a
    list attribute was not replayed: wrong loss and gradients."""
    for holder in ("class", "list"):
        for rank, res in enumerate(results):
            assert res[f"own-generator-{holder}"] == [(True, 4, True)] * 2, (holder, rank, res[f"own-generator-{holder}"])


@pytest.mark.multiprocess
def test_a_forward_input_refused_says_forward(results):
    """8. (a new user's trial) a forward() of a batch smaller than m was refused as "the step input"; it also says
    what to do with an evaluation set's last batch."""
    refusal = ("batch size 1 is smaller than num_microbatches=2; every microbatch needs at least one sample (use a "
               "batch of >= 2); for the last, smaller batch of an evaluation set: pad it to num_microbatches samples "
               "(repeat a row) and drop the padded rows' outputs")
    (kind0, text0), (kind1, text1) = (res["forward-small-batch"] for res in results)
    assert kind0 == kind1 == "ValueError" and text0.startswith(refusal), (text0, text1)
    assert text1.startswith(f"the rank of stage 0 (pipeline rank 0) rejected the forward() input: {refusal}"), text1


@pytest.mark.filterwarnings("ignore:profile_layers")  # its wall-clock warning: times are not looked at here
def test_profiling_leaves_a_layer_s_own_generator_as_it_was():
    layers = nn.Sequential(rt_s15_hunt.NoisyLinear(1), rt_s15_hunt.NoisyLinear(2))
    before = [layer.gen.get_state() for layer in layers]
    profile_layers(layers, torch.randn(4, 8), target=torch.randn(4, 8), loss_fn=F.mse_loss, repeat=2, warmup=1)
    assert all(torch.equal(layer.gen.get_state(), state) for layer, state in zip(layers, before))


def test_signature_says_whether_x_requires_grad():
    x = torch.zeros(4, 3)
    plain = encode_signature(True, 2, [(x[:2],), (x[2:],)], 0)
    x.requires_grad_()
    wanting = encode_signature(True, 2, [(x[:2],), (x[2:],)], 0)
    assert plain[6] == DTYPE_CODE[torch.float32] and wanting[6] == DTYPE_CODE[torch.float32] + REQUIRES_GRAD
    assert plain[:6] + plain[7:] == wanting[:6] + wanting[7:]


@pytest.mark.multiprocess
def test_a_save_ends_at_once_when_a_peer_has_left(tmp_path):
    """3. (divergehunt) save_checkpoint's vote waited the whole timeout for a rank whose launch fn had ended; it now
    watches the Pipeline's failure keys and names the departure at once."""
    kind, text, seconds = launch(rt_s15_hunt.save_while_peer_exits, 2, str(tmp_path), timeout=120)[0]
    assert kind == "PipelineError" and seconds < 10, (kind, text, seconds)
    assert "world rank 1 (pipeline rank 1) ended without closing its Pipeline" in text, text
    assert "while waiting in save_checkpoint (the vote on its arguments)" in text, text
    assert not (tmp_path / "ck").exists()


@pytest.mark.multiprocess
def test_a_save_after_close_on_every_rank_still_works(tmp_path):
    assert [r[0] for r in launch(rt_s15_hunt.save_after_close, 2, str(tmp_path), timeout=120)] == ["ok", "ok"]
    assert (tmp_path / "ck" / ".metadata").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stay", [True, False])
def test_save_on_rank_0_only_names_the_checkpoint_on_both_ranks(tmp_path, stay):
    """4. (divergehunt) rank 1's step blamed itself with gloo's raw timeout; it now says rank 0 was in
    save_checkpoint and that checkpoint calls are collective, whether rank 0 is still there (its own timeout's
    failure) or has gone (rank 0's departure); rank 0's TimeoutError says so too."""
    (kind0, text0, _), (kind1, text1, _) = launch(rt_s15_hunt.save_on_rank_0_only, 2, str(tmp_path), stay,
                                                  timeout=120)
    assert kind0 == "TimeoutError" and "world ranks [1] did not reach save_checkpoint" in text0, text0
    assert "(they are collective: on every rank, not only under `if rank == 0`)" in text0, text0
    assert kind1 == "PipelineError", (kind1, text1)
    assert ("meanwhile world rank 0 was in save_checkpoint (the vote on its arguments), a checkpoint call this rank "
            "did not make: save_checkpoint and load_checkpoint are collective") in text1, text1


@pytest.mark.filterwarnings("ignore::pipesched.runtime.SingleProcessWarning")
def test_an_attribute_the_pipeline_does_not_have_is_refused(no_launcher):
    """6. (a new user's trial) ``pipe.anticipate_clips = True`` (a typo) and ``pipe.num_microbatches = 8`` were
    accepted and ignored; the settable attributes still are settable."""
    pipe = Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), num_microbatches=2, loss_fn=F.mse_loss)
    for name in ("anticipate_clips", "num_microbatches"):
        with pytest.raises(AttributeError, match=rf"^Pipeline has no attribute '{name}' to set; the settable ones are "
                                                 r"loss_fn, anticipate_clip \(the rest is fixed at construction: build "
                                                 r"a new Pipeline to change it; to keep your own data on it, subclass "
                                                 r"Pipeline\)$"):
            setattr(pipe, name, 8)
        assert not hasattr(pipe, name)
    for name in ("autocast", "balance", "timeout", "program"):  # set at construction: a new value would be ignored
        before = getattr(pipe, name)
        with pytest.raises(AttributeError, match=rf"^Pipeline.{name} is fixed at construction \(the Pipeline was "
                                                 r"built with it\): build a new Pipeline to change it; the settable "
                                                 r"attributes are loss_fn, anticipate_clip$"):
            setattr(pipe, name, None)
        assert getattr(pipe, name) is before
    pipe.loss_fn, pipe.anticipate_clip = F.l1_loss, True
    assert pipe.loss_fn is F.l1_loss and pipe.anticipate_clip is True
    del pipe.loss_fn  # a settable one stays settable
    pipe.loss_fn = F.mse_loss
    pipe.close()


class _Counting(Pipeline):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_done = 0  # a subclass keeps its own state on the object


@pytest.mark.filterwarnings("ignore::pipesched.runtime.SingleProcessWarning")
def test_a_subclass_keeps_its_own_attributes_but_not_the_fixed_ones(no_launcher):
    pipe = _Counting(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), num_microbatches=2, loss_fn=F.mse_loss)
    pipe.steps_done += 1
    pipe.note = "mine"
    assert (pipe.steps_done, pipe.note) == (1, "mine")
    with pytest.raises(AttributeError, match=r"^_Counting.autocast is fixed at construction"):
        pipe.autocast = torch.bfloat16
    pipe.close()


def test_latest_checkpoint_refuses_a_file_and_a_checkpoint(tmp_path):
    """7. (a new user's trial) ``latest_checkpoint`` answered None for a file and for a checkpoint's own path, so
    ``if path: load_checkpoint(...)`` silently started again from step 0; a folder that does not exist (yet: a
    first run) still answers None."""
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"^latest_checkpoint: directory '.*notes.txt' is a file, not the "
                                                 r"folder that holds the checkpoints$"):
        latest_checkpoint(tmp_path / "notes.txt")
    (tmp_path / "step-000001").mkdir()
    (tmp_path / "step-000001" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a checkpoint itself; pass the folder that holds the checkpoints "
                                         rf"\('{tmp_path}'\), or load_checkpoint\("):
        latest_checkpoint(tmp_path / "step-000001")
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(ValueError, match=r"^latest_checkpoint: directory is '' \(an unset setting\?\); pass the "):
        latest_checkpoint("")  # e.g. os.environ.get("CKPT_DIR", "")


@pytest.mark.multiprocess
def test_a_failed_clip_names_clip_not_run_collective():
    """9. (the divergent-call hunt) clip_grad_norm_'s and the GradScaler's failures said "(run_collective)", a call
    the user never made: each names its public call now."""
    (kind0, text0), (kind1, text1) = launch(rt_s15_hunt.clip_on_one_rank, 2, timeout=120)
    assert kind0 == kind1 == "PipelineError", (text0, text1)
    assert text0.startswith("pipeline rank failure: world rank 0 (pipeline rank 0) failed outside any instruction "
                            "(while preparing or finishing the step): RuntimeError: clip_grad_norm_: "), text0
    assert text1.startswith("pipeline rank failure: world rank 1 (pipeline rank 1) failed in a collective call "
                            "outside any step (clip_grad_norm_): RuntimeError: clip_grad_norm_: pipeline ranks [1] "
                            "are in clip_grad_norm_'s collective while ranks [0] opened the next step"), text1


@pytest.mark.multiprocess
def test_a_stalled_rank_is_named_by_every_rank_with_replicas():
    """10. (the divergent-call hunt) DP 2 x PP 2, world rank 1 stalls: world rank 2, which waited for a replica (world
    rank 0) and shares no group with rank 1, named nobody (the roll call was heard in this rank's groups only); every
    rank answers under a key of the whole job now, so every rank names world rank 1."""
    assert launch(rt_s15_hunt.stall_with_replicas, 4, timeout=120) == [("PipelineError", (1,))] * 4


@pytest.mark.multiprocess
def test_a_model_of_other_shapes_is_refused_naming_the_first_tensor_that_differs():
    """11. (a new user's trial) the refusal named two digests only; it names the first differing tensor now."""
    texts = launch(rt_s15_hunt.other_width_on_rank_1, 2, timeout=120)
    assert "; the first difference: '0.weight' has shape (16, 16) on world rank 1 but (8, 8) on world rank 0; " \
           "every rank must construct Pipeline with the same arguments (and the same model)" in texts[0], texts[0]
    assert "; the first difference: '0.weight' has shape (8, 8) on world rank 0 but (16, 16) on world rank 1; " \
           in texts[1], texts[1]


def test_first_difference_says_what_differs_or_is_missing():
    mine = {"0.weight": (8, 8), "0.bias": (8,)}
    assert first_difference(mine, dict(mine), "A", "B") == ""
    assert first_difference(mine, {"0.weight": (8, 8)}, "A", "B") == "'0.bias' (shape (8,)) is in the model on A but not on B"
    assert first_difference(mine, {**mine, "1.weight": (2, 2)}, "A", "B") == \
        "'1.weight' (shape (2, 2)) is in the model on B but not on A"
    assert first_difference(mine, {"0.weight": (8, 4), "0.bias": (8,)}, "A", "B") == \
        "'0.weight' has shape (8, 4) on B but (8, 8) on A"


@pytest.mark.multiprocess
def test_an_emergency_save_after_a_peer_was_lost_ends_at_once(tmp_path):
    """13. (same) rank 0 caught the PipelineError naming rank 1 lost, then saved: the vote waited the whole timeout
    for the lost rank (its record was there before the vote); a lost rank never votes, so it ends at once now."""
    with pytest.raises(RuntimeError, match="rank 1"):
        launch(rt_s15_hunt.save_after_a_peer_was_lost, 2, str(tmp_path), timeout=120, grace=60)
    (step_kind, step_text, _), (save_kind, save_text, seconds) = json.loads((tmp_path / "rank0.json").read_text())
    assert step_kind == "PipelineError" and "world rank 1 (pipeline rank 1) was lost" in step_text, step_text
    assert save_kind == "PipelineError" and seconds < 10, (save_kind, save_text, seconds)
    assert "world rank 1 (pipeline rank 1) was lost" in save_text, save_text
    assert "while waiting in save_checkpoint (the vote on its arguments)" in save_text, save_text


@pytest.mark.multiprocess
def test_an_old_vote_is_not_named_by_a_later_timeout(tmp_path):
    """14. (same) a step's timeout named a checkpoint vote rank 0 had given up on long before (and stepped since)."""
    (first0, (kind0, _)), (first1, (kind1, text1)) = launch(rt_s15_hunt.old_vote_not_named, 2, str(tmp_path),
                                                            timeout=120)
    assert (first0, first1, kind1) == ("ok", "ok", "PipelineError"), (first0, first1, kind1, text1)
    assert "did not time out within 1 s of this rank" in text1 and "save_checkpoint" not in text1, text1
