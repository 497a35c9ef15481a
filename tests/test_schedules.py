"""Named schedules: registry errors, the exact orders of the small cases, microbatch-count rules."""
import pytest

from pipesched import SCHEDULES, ScheduleArgumentError, UnknownScheduleError, build, get_schedule


def _streams(program):
    return [" ".join(str(i) for i in stream) for stream in program.ranks]


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(UnknownScheduleError, match="valid names: 1f1b, dualpipev, gpipe, interleaved-1f1b"):
        get_schedule("no-such-schedule")


def test_every_schedule_names_its_paper():
    for info in SCHEDULES.values():
        assert "arXiv:" in info.paper and "arXiv:" in info.build.__doc__


def test_gpipe_order():
    assert _streams(build("gpipe", 2, 2)) == ["F0.0 F0.1 B0.0 B0.1", "F1.0 F1.1 B1.0 B1.1"]


def test_1f1b_order():
    assert _streams(build("1f1b", 3, 4)) == [
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3",
        "F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3",
        "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3",
    ]


def test_1f1b_with_fewer_microbatches_than_ranks_runs_gpipe_like():
    assert _streams(build("1f1b", 4, 2))[0] == "F0.0 F0.1 B0.0 B0.1"


def test_interleaved_placement_is_looped():
    program = build("interleaved-1f1b", 2, 4, 2)
    assert program.stage_to_rank == (0, 1, 0, 1)
    assert _streams(program)[0] == "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"


def test_interleaved_accepts_m_not_a_multiple_of_p():
    program = build("interleaved-1f1b", 4, 6, 2)  # PyTorch and Megatron reject this
    assert program.num_microbatches == 6 and len(program) == 4 * 2 * 6 * 2


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_one_stage_schedules_reject_virtual_stages(name):
    with pytest.raises(ScheduleArgumentError, match="virtual_stages=2: .* must be 1"):
        build(name, 2, 4, 2)


@pytest.mark.parametrize("argument, args", [("num_ranks", (0, 4)), ("num_microbatches", (2, 0)),
                                             ("num_microbatches", (2, 2.5))])
def test_bad_sizes_name_the_argument(argument, args):
    with pytest.raises(ScheduleArgumentError, match=f"{argument} must be an integer >= 1"):
        build("1f1b", *args)
