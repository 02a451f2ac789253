"""Python's cyclic garbage collector, paused over start-up work that allocates much and frees little.

Why: a collection of the oldest generation walks every tracked object in the process, and
the trainer has hundreds of thousands before it reads its config (torch, transformers,
Composer). Reading a run allocates as many more that all stay alive (the YAML's dicts and
lists, the typed config, the plan and its catalogs, the loader's and streaming's per-stream
objects), so the collector's thresholds are crossed again and again and each pass walks the
whole heap to free nothing (figures: docs/measured.md). CPython 3.12 and 3.13 collect by the
same generational thresholds; 3.14's incremental collector does less per pass, and pausing
it is as correct.

Pausing changes only *when* cycles are freed, never whether: every object is still freed
by reference counting when it is dropped, and cycles made while paused are collected by
the first collection after (Composer's build, :func:`foundrymix.train.builder.freeze_built_heap`).
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
