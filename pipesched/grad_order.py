"""The order in which each stage adds up its microbatches' weight gradients.

A stage's ``.grad`` is the sum over microbatches of their weight gradients, added as each ``B`` (or, with a split
backward, each ``W``) runs. Floating-point addition is not associative, so gradients equal the unsplit model's run
one microbatch at a time *bitwise* only when every stage adds them in microbatch order 0, 1, ..., m-1, as every
built-in schedule does; a program that runs them in another order gives the same sum up to rounding (~1e-7
of a parameter's largest gradient; a gradient that is 0 up to rounding can differ by 100% of itself).
``pipesched validate`` says so for such a program. Torch-free.
"""
from __future__ import annotations

from .ir import Op, Program


def weight_gradient_order(program: Program) -> dict[int, list[int]]:
    """``{stage: [microbatch, ...]}``: the microbatches in the order their ``B`` or ``W`` runs on the stage's rank."""
    order: dict[int, list[int]] = {s: [] for s in range(program.num_stages)}
    for stream in program.ranks:
        for instr in stream:
            if instr.op in (Op.B, Op.W):
                order[instr.stage].append(instr.microbatch)
    return order


def out_of_order(program: Program) -> dict[int, list[int]]:
    """The stages of a training ``program`` whose weight gradients are not added in microbatch order, with their
    order (``{}``: bitwise equality with the unsplit model's microbatch-by-microbatch run is possible)."""
    if program.forward_only:
        return {}
    return {s: mbs for s, mbs in weight_gradient_order(program).items() if mbs != sorted(mbs)}


def order_note(program: Program) -> str:
    """A sentence for ``pipesched validate``: ``""`` where every stage adds its weight gradients in microbatch
    order, else which stages do not and what follows (gradients equal up to rounding, not bitwise)."""
    late = out_of_order(program)
    if not late:
        return ""
    shown = "; ".join(f"stage {s}: {', '.join(map(str, mbs))}" for s, mbs in list(late.items())[:3])
    more = f" (and {len(late) - 3} more stages)" if len(late) > 3 else ""
    return (f"Note: weight gradients are added out of microbatch order ({shown}{more}), so they equal the unsplit "
            f"model's up to float rounding (~1e-7 of a parameter's largest gradient), not bitwise; run each stage's "
            f"B (or W) in microbatch order for bitwise gradients")
