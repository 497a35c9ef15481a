"""The garbage-collector pause that keeps passes over large programs linear in time (:func:`paused_gc`)."""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused_gc():
    """Pause the cyclic garbage collector for a pass over a large program (also usable as a decorator).

    Building, lowering, validating and simulating a program allocate an object or two per instruction
    (instructions, events, tuples), none of them in a reference cycle. With hundreds of thousands of
    them alive, each full collection the allocations trigger walks every live object, finds nothing to
    free, and costs more than the pass itself (``benchmarks/bench_compile.py`` at p=128, m=512, v=2 takes
    1.7x as long without the pause). Reference counting still frees everything; the collector resumes (if
    it was running) when the pass ends, however it ends.

    When it resumes, the objects made during the pass (the program or timeline it returns: one or two
    per instruction) would be walked by the next young collections, only to survive them. Instead every
    tracked object is moved to the oldest generation unwalked (``gc.freeze()`` then ``gc.unfreeze()``),
    which the collector visits only in its rare full collections; nothing is exempt from collection.
    This is skipped if the caller keeps frozen objects of its own (``gc.get_freeze_count() > 0``).

    Applied once per public entry point (:func:`pipesched.build`, :func:`~pipesched.lower.add_send_recv`,
    :func:`~pipesched.validate.validate`, :func:`~pipesched.simulate`), not inside the passes they call.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
