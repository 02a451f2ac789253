"""Python's cyclic garbage collector, paused over start-up work that allocates much and frees little.

Why: reading a run allocates hundreds of thousands of objects that all stay alive, so each pass
of the oldest generation walks the whole heap to free nothing (benchmarks/bench_gc.py). Pausing
changes only *when* cycles are freed, never whether.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """``gc.disable()`` for the block, restored after (nested blocks and a caller that had
    already disabled the collector keep it as they had it)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
