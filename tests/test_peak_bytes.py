"""Peak activation bytes when only a recomputing stage's sizes are given (stash 0): the sizes that matter are
found before the program is scanned for recomputed pairs, and found right."""
import pipesched as ps
from pipesched.lower import add_recompute
from pipesched.memory import peak_activation_bytes

SIZES = ps.CostModel(input_bytes=5, recompute_bytes=8)  # stash_bytes 0: only a recomputed stage holds anything


def test_recompute_sizes_alone_give_the_hand_computed_peaks():
    # rank 0: F0.0 F0.1 R0.0 B0.0 R0.1 B0.1 -> 5, 10, 13 (R0.0 raises 5 to 8), 5, 8, 0: peak 13
    # rank 1: F1.0 R1.0 B1.0 F1.1 R1.1 B1.1 -> 5, 8, 0, 5, 8, 0: peak 8
    program = add_recompute(ps.build("1f1b", 2, 2))
    assert peak_activation_bytes(program, SIZES) == (13.0, 8.0)
    lowered = ps.compile_program("1f1b", 2, 2, recompute=True)
    assert ps.simulate(lowered, SIZES).peak_activation_bytes == (13.0, 8.0)


def test_sizes_that_do_not_matter_give_none():
    assert peak_activation_bytes(ps.build("1f1b", 2, 2), SIZES) is None  # nothing recomputed: inputs not held
    assert peak_activation_bytes(add_recompute(ps.build("1f1b", 2, 2)), ps.CostModel()) is None  # no size at all
