"""``foundrymix plan``'s eval set: what every evaluation of the ``eval_loader`` reads, from the
plan of the loader the trainer evaluates on (whole global batches, at most ``eval_subset_num_batches``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.data_config import batch_per_rank


@dataclass(frozen=True)
class EvalPlan:
    """One evaluation: the eval set's rows, the batches read and the rows not evaluated."""

    rows: int                  # rows in the eval set (after each stream's choose/proportion)
    rows_per_stream: dict[str, int]
    global_batch_size: int     # eval rows per batch over all ranks
    batches: int               # batches per evaluation
    rows_evaluated: int
    left_out_by_batches: int   # rows past the last whole global batch
    left_out_by_subset: int    # whole batches past eval_subset_num_batches

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        per_stream = ', '.join(f'{k} {v:,}' for k, v in self.rows_per_stream.items())
        line = (f'eval: {self.rows:,} rows ({per_stream}) in global batches of {self.global_batch_size:,}: '
                f'{self.batches:,} batches per evaluation, {self.rows_evaluated:,} rows evaluated; '
                f'{self.left_out_by_batches:,} left out by whole batches')
        if self.left_out_by_subset:
            line += f', {self.left_out_by_subset:,} more past eval_subset_num_batches'
        return line


def eval_plan(cfg: Any, world_size: int = 1, nodes: int = 1) -> Optional[EvalPlan]:
    """The eval set of a checked training config on ``world_size`` ranks (None without
    ``eval_loader``), as the trainer's evaluator reads it."""
    if cfg.eval_loader is None:
        return None
    # a data-only YAML has no trainer keys: the trainer's defaults (the per-rank train batch, every batch)
    eval_batch = getattr(cfg, 'device_eval_batch_size', None) or batch_per_rank(cfg, world_size)
    plan = StreamMixer(cfg.eval_loader, 'eval_loader').plan(eval_batch, None, world_size, nodes)
    per_stream = dict(plan.nominal_rows_per_epoch)  # what the weights ask for, before whole batches
    whole = plan.batches_per_epoch
    subset = getattr(cfg, 'eval_subset_num_batches', -1)
    batches = whole if subset < 0 else min(whole, subset)
    gbs = plan.global_batch_size
    return EvalPlan(rows=sum(per_stream.values()), rows_per_stream=per_stream, global_batch_size=gbs,
                    batches=batches, rows_evaluated=batches * gbs,
                    left_out_by_batches=sum(plan.left_out_per_epoch.values()),
                    left_out_by_subset=(whole - batches) * gbs)


def eval_json(cfg: Any, world_size: int, nodes: int) -> dict[str, Any]:
    """``{'eval': ...}`` for ``plan --json``, or nothing without ``eval_loader``."""
    plan = eval_plan(cfg, world_size, nodes)
    return {} if plan is None else {'eval': plan.to_dict()}


def print_eval(cfg: Any, world_size: int, nodes: int, console: Any) -> None:
    """The eval set in one line under the plan's tables (nothing without ``eval_loader``)."""
    plan = eval_plan(cfg, world_size, nodes)
    if plan is not None:
        console.print(plan.text(), markup=False)
