"""A schedule of your own: GPipe in chunks of ``p`` microbatches, registered as ``chunked-gpipe``.

Each rank runs the forwards of a chunk of up to ``p`` microbatches, then their backwards, then the next chunk: at
most ``p`` microbatches in flight per rank (GPipe holds ``m``), with a bubble per chunk. Importing this module
registers it (in this process), so::

    pipesched --schedule-module examples/chunked_gpipe.py show chunked-gpipe -p 2 -m 4
    pipesched --schedule-module examples/chunked_gpipe.py simulate chunked-gpipe -p 4 -m 8

and, in a training script, ``import chunked_gpipe`` (on every rank) before ``Pipeline(model,
schedule="chunked-gpipe", ...)``. ``tests/test_registry.py`` property-tests it, ``tests/runtime/test_user_programs.py``
runs it.
"""
from __future__ import annotations

import pipesched as ps
from pipesched import Instr, Op, Program


def build_chunked_gpipe(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Program:
    """The compute-only program: for each chunk of up to ``num_ranks`` microbatches, every forward, then every
    backward (in the same microbatch order). One stage per rank (stage ``r`` on rank ``r``).

    Raises:
        pipesched.ScheduleArgumentError: ``virtual_stages`` other than 1.
    """
    if virtual_stages != 1:
        raise ps.ScheduleArgumentError(f"virtual_stages={virtual_stages!r}: chunked-gpipe places one stage per rank",
                                       argument="virtual_stages")
    chunks = [range(start, min(start + num_ranks, num_microbatches))
              for start in range(0, num_microbatches, num_ranks)]
    streams = []
    for rank in range(num_ranks):
        stream = []
        for chunk in chunks:
            stream += [Instr(Op.F, rank, mb) for mb in chunk] + [Instr(Op.B, rank, mb) for mb in chunk]
        streams.append(stream)
    return Program(streams, stage_to_rank=tuple(range(num_ranks)), num_microbatches=num_microbatches,
                   schedule="chunked-gpipe")


ps.register_schedule("chunked-gpipe", build_chunked_gpipe,
                     "GPipe in chunks of p microbatches: at most p in flight per rank",
                     inflight="min(p, m)", microbatches="any m >= 1")



if __name__ == "__main__":  # run as a script: show what importing it registers
    from pipesched.errors import render_grid

    program = ps.compile_program("chunked-gpipe", 2, 4)
    print("registered 'chunked-gpipe' in this process (import this module on every rank, or pass it to "
          "--schedule-module, to use it); at p=2, m=4:")
    print(render_grid(program.ranks))
    print(f"simulated bubble fraction (unit costs): {ps.simulate(program).bubble_fraction:.3f}")
