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
            counts = stage.plan.order.trained(done)
        else:  # the decided segments' rows, and the current segment's batches so far
            k = controller.segment_of(stage.start_batch + done)
            into = stage.start_batch + done - controller.segment_start(k)
            counts = controller.consumed_before(min(k, controller.segments)).copy()
            if into and k < controller.segments:
                ids = controller.segment_ids(k)[:into * controller.global_batch]
                counts += np.bincount(controller.stream_of(ids), minlength=len(counts))
        for name, n in zip(stage.stream_names, np.asarray(counts).tolist()):
            out[name] += int(n)
    return out
