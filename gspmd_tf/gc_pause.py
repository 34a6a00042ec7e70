"""Pausing Python's cyclic garbage collector around the package's bulk work.

Importing, propagating, lowering and building the local backend's per-device graph
each allocate a few Python objects per op. With TF's hundreds of thousands of live
objects, every full collection those allocations trigger walks all of them: ~20% of the
build of the 64-layer FFN train step on a 2x4 mesh. Their garbage is freed by reference counting; any cycles wait for the
next collection after the pause. (A pause per gt.Variable does not help: the
collections it defers run right after it, between one variable and the next.)
"""

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Runs the block with the cyclic garbage collector off, then restores it (left off
    if it was off: nested pauses and a user's gc.disable() are kept)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
