"""User programs and user schedules in a Pipeline (2 gloo ranks), against the unsplit model: the catalogue's
hand-written example, a registered schedule, a looped program, a program with its own R/I/W and one with its own
dp_size, all bitwise (dp: 1e-6 relative); bad programs refused on every rank before any communication."""
import pytest

from pipesched.runtime import launch

import rt_user_programs

pytestmark = pytest.mark.multiprocess

BITWISE_STEP = (4, True, True)  # (this rank's parameters compared: 2 of 4 layers x weight/bias, grads, loss)


@pytest.fixture(scope="module")
def results():
    return launch(rt_user_programs.suite, 2, timeout=300)


@pytest.mark.parametrize("case, schedule, m, stage_ids", [
    ("handwritten", "handwritten-1f1b", 3, [(0,), (1,)]),
    ("registered", "chunked-gpipe", 4, [(0,), (1,)]),
    ("looped", "interleaved-1f1b", 4, [(0, 2), (1, 3)]),
    ("own-r-i-w", "1f1b", 4, [(0,), (1,)]),
    ("after", "handwritten-1f1b", 3, [(0,), (1,)]),
])
def test_a_user_program_runs_bitwise_like_the_unsplit_model(results, case, schedule, m, stage_ids):
    for rank, res in enumerate(results):
        out = res[case]
        steps = 1 if case == "after" else 2
        assert out["steps"] == [BITWISE_STEP] * steps, (rank, out)
        assert out["params_equal"] is True
        assert out["forward"] is (True if rank == 1 else None)
        assert (out["schedule"], out["m"], out["stage_ids"]) == (schedule, m, stage_ids[rank])
        assert out["programs_derived"] is True  # early receives and forward-only derived as from a compiled one


def test_uneven_microbatches_with_the_programs_m(results):
    for res in results:
        assert res["handwritten-uneven"]["steps"] == [BITWISE_STEP]  # 7 rows into 3, 2, 2


def test_a_programs_own_recompute_and_split_backward_stand(results):
    for res in results:
        assert (res["own-r-i-w"]["R"], res["own-r-i-w"]["I"]) == ([0, 1], [1])


def test_a_registered_schedule_is_registered_in_each_rank_by_importing_its_module(results):
    assert [res["registered-import"] for res in results] == [("chunked-gpipe",)] * 2


def test_a_programs_dp_size_wins(results):
    for res in results:
        out = res["own-dp"]
        assert out["dp"] == (2, 1) and out["loss_equal"] is True
        assert out["worst"] <= 1e-6, out


def test_a_deadlocking_program_is_refused_with_the_validators_error_on_every_rank(results):
    for res in results:
        kind, message = res["deadlock"]
        assert kind == "DeadlockError"
        assert message.startswith("rank 0, SEND_F0.1>1: deadlock: no rank can make progress and work remains")


def test_programs_the_pipeline_cannot_run_are_refused_on_every_rank(results):
    expect = {
        "ranks": ("ValueError", "the program has 4 ranks (num_ranks) but the pipeline has 2 (world size 2 / dp_size 1)"
                                "; launch 4 x dp_size processes, or use a program for 2 ranks"),
        "microbatches": ("ValueError", "num_microbatches=4, but the program runs 3 microbatches "
                                       "(program.num_microbatches); leave num_microbatches at its default or pass 3"),
        "recompute": ("ValueError", "recompute=True with a Program: the program's own R instructions decide it "
                                    "(stages []); pass recompute=False, or apply pipesched.add_recompute to the "
                                    "compute-only program before lowering it"),
    }
    for res in results:
        for case, (kind, message) in expect.items():
            assert res[case] == (kind, message), (case, res[case])


def test_a_builder_giving_the_ranks_other_programs_is_named_as_such_on_every_rank(results):
    # the arguments were identical, yet the message said only "every rank must construct Pipeline with the same
    # arguments" (a hunt of user schedules)
    for rank, res in enumerate(results):
        kind, message = res["by-rank"]
        assert kind == "ValueError"
        assert message.startswith(f"world rank {1 - rank} built its Pipeline with program fingerprint=")
        assert message.endswith(" (the schedule, sizes and options agree: the schedule's builder gave these ranks "
                                "other instructions, so it must not depend on random draws, the time or the rank; or "
                                "the Program passed as schedule= differs between them); every rank must construct "
                                "Pipeline with the same arguments (and the same model)")
