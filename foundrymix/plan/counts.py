"""Rows of each stream trained before a global batch, by arithmetic on the run's plan: a resumed
loader (on any number of ranks) must report every rank's rows trained before it."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from foundrymix.plan.adaptive import AdaptiveController
from foundrymix.plan.stages import RunPlan


def rows_before(run: RunPlan, batch: int,
                adaptive: Mapping[int, AdaptiveController] | None = None) -> dict[str, int]:
    """Run-wide stream name -> rows of it in global batches ``[0, batch)`` (all ranks);
    ``adaptive``: stage index -> its controller, whose decisions fix its segments' rows."""
    out = dict.fromkeys(run.stream_names, 0)
    for stage in run.stages:
        if stage.start_batch >= batch:
            break
        done = min(batch, stage.end_batch) - stage.start_batch
        controller = (adaptive or {}).get(stage.index)
        if controller is None:
            assert stage.order is not None
            counts = stage.order.trained(done)
        else:  # the decided segments' rows, and the current segment's batches so far
            spec = controller.spec
            k = spec.segment_of(stage.start_batch + done)
            into = stage.start_batch + done - spec.segment_start(k)
            counts = controller.consumed_before(min(k, spec.segments))
            if into and k < spec.segments:
                counts = counts + controller.block(k, np.zeros_like(counts)).prefix_counts(into * spec.global_batch)
        for name, n in zip(stage.stream_names, np.asarray(counts).tolist()):
            out[name] += int(n)
    return out
