"""Pausing Python's cyclic garbage collector around work that allocates a great many objects that live
on (imports, a cluster's start) or die young and acyclic (a scheduling round): with torch and a user's
modules loaded, each full collection such work triggers walks hundreds of thousands of objects (some
0.2-0.3 s of CPU on a two-core VM)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection while the block runs, then as before. The switch is process-wide: other
    threads' cycles wait as long, so hold it for a bounded stretch of work. Reference counting still frees
    what is not in a cycle."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
