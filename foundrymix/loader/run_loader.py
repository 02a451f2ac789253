"""The run's one DataLoader: every stage's batches in the plan's order, switched at exact
batches -- for every run (a run without ``stages:`` is one stage).

Why one loader and one Composer ``fit``: the LR schedule, the optimizer and the
checkpoints belong to the whole run, and Composer checkpoints the train loader's
``dataset.state_dict``. So :class:`StagedDataLoader` is a ``DataLoader`` whose ``dataset``
is a :class:`StagedPosition` -- the run's position, one global batch index, what Composer
saves and loads -- and whose iterator reads spans of batches of the stage at the position
(:mod:`foundrymix.loader.span`): batch ``b`` of a stage is ``stage.plan.order.batch(b)``
(an adaptive stage: its controller's segment), this rank's columns of it read by index from
the stage's storage. Nothing is replayed: resuming at any batch, on any number of ranks
with the same global batch, starts reading there.

For a run without stages, ``composer_epochs`` (the trainer's setting) makes one iteration
of the loader one epoch of its mixture, so Composer's epochs -- ``max_duration: 3ep``,
``save_interval: 1ep`` -- are data epochs; a staged or adaptive run is one Composer epoch,
and a plain ``for`` loop over the loader (the default) runs the whole run.

The position and the rules for changing the data on resume: :mod:`foundrymix.loader.position`.
"""

from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from foundrymix.loader.position import POSITION_VERSION, Resumed, StagedPosition  # noqa: F401 (re-exported)
from foundrymix.plan.adaptive import AdaptiveController
from foundrymix.plan.stages import RunPlan, StagePlan

log = logging.getLogger(__name__)


@dataclass
class _Active:
    """The stage being read: its storage (rows read by index)."""

    stage: StagePlan
    store: Any


class StagedDataLoader(DataLoader):
    """Batches of every stage in order; ``stream_id`` is the run-wide stream index and, in a
    run with ``stages:``, ``stage_id`` the stage of each sample."""

    def __init__(self, run: RunPlan, batch_size: int, composer_epochs: bool = False,
                 rank: Optional[int] = None) -> None:
        super().__init__(StagedPosition(run), batch_size=batch_size)
        self.run = run
        #: the global rank whose slice of every global batch this loader yields (default:
        #: the launcher's ``RANK``)
        self.rank = rank
        #: every iteration starts at the first batch (an evaluation set)
        self.rewind = False
        #: called before each batch with this rank's read failure or None; a
        #: :class:`~foundrymix.loader.together.StopTogether` stops every rank together
        self.stop_together: Optional[Callable[[Optional[BaseException]], None]] = None
        if composer_epochs and (run.explicit or any(s.config is not None and s.config.adaptive
                                                    for s in run.stages)):
            # A staged run is one Composer epoch: ending Composer epochs at stage switches
            # would renumber epochs after a resume exactly at a switch (Composer saved
            # batch_in_epoch > 0 there and would count on). An adaptive run has no epochs of
            # one mixture: one Composer epoch too.
            composer_epochs = False
        self.composer_epochs = composer_epochs
        self.stream_names = run.stream_names
        column = {n: i for i, n in enumerate(self.stream_names)}  # list.index: O(N^2) at 10,000 streams
        self._maps = [torch.tensor([column[n] for n in s.stream_names])
                      for s in run.stages]
        self._active: Optional[_Active] = None

    @property
    def position(self) -> StagedPosition:
        return self.dataset  # type: ignore[return-value]

    @property
    def plan(self) -> RunPlan:
        """The run's plan, what ``foundrymix plan`` prints: every stage, its mixture and length."""
        return self.run

    @property
    def world_size(self) -> int:
        """The ranks that share each global batch (every stage splits its own over the same ranks)."""
        stage = self.run.stages[0]
        return stage.global_batch_size // stage.batch_size

    def samples_per_stream(self) -> dict[str, int]:
        """Stream name -> rows of it in the global batches before the position, all ranks'
        (the plan's arithmetic, :func:`~foundrymix.plan.counts.rows_before`): after a resume,
        the whole run's so far."""
        from foundrymix.plan.counts import rows_before
        return rows_before(self.run, self.position.batch, self.position.adaptive)

    @property
    def storage(self) -> Any:
        """The storage (:class:`~foundrymix.loader.storage.RowStore`) of the stage being
        read, or None before the first batch (:meth:`prepare` builds it) and after
        :meth:`release`. A stage's storage is kept until the next stage's is built."""
        return self._active.store if self._active is not None else None

    def prepare(self) -> None:
        """Build the storage of the stage at the position now (cache claims and checks,
        shard files): what refuses a run refuses it here, before the first batch is due."""
        if self.position.batch < self.run.total_batches:
            self._activate(self.run.stage_at(self.position.batch))

    def state_dict(self) -> dict[str, Any]:
        """The position (next global batch, trained stages' fingerprints, adaptive state):
        what a checkpoint keeps. Under Composer the position itself is checkpointed."""
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a :meth:`state_dict`'s batch (the trained past checked unchanged)."""
        self.release()
        self.position.load_state_dict(state)

    def __len__(self) -> int:
        """Batches of one iteration: the whole run, or (``composer_epochs``, one stage) one
        epoch of its mixture -- Composer yields at most this many per epoch and converts
        ``ep`` times (``t_warmup: 1ep``) with it."""
        if not self.composer_epochs:
            return self.run.total_batches
        return max(s.plan.batches_per_epoch for s in self.run.stages)

    def __iter__(self) -> Iterator[Any]:
        position = self.position
        if self.rewind:
            position.batch = 0
        while position.batch < self.run.total_batches:
            stage = self.run.stage_at(position.batch)
            end = self._span_end(stage, position)
            yield from self._span(stage, position, end)
            if self.composer_epochs and (position.batch - stage.start_batch) % \
                    stage.plan.batches_per_epoch == 0:
                return

    def _span_end(self, stage: StagePlan, position: StagedPosition) -> int:
        """Where the batches from the position on stop being one span: the stage's end, the
        end of the current adaptive segment (the next one is decided from the loss), or --
        one Composer epoch per iteration -- the end of the current epoch."""
        end = stage.end_batch
        controller = position.adaptive.get(stage.index)
        if controller is not None:
            k = controller.segment_of(position.batch)
            end = min(end, controller.segment_start(k) + controller.segment_batches(k))
        elif self.composer_epochs:
            bpe = stage.plan.batches_per_epoch
            done = position.batch - stage.start_batch
            end = min(end, stage.start_batch + (done // bpe + 1) * bpe)
        return end

    def _span(self, stage: StagePlan, position: StagedPosition, end: int) -> Iterator[Any]:
        """Batches ``[position, end)`` of ``stage``, read in workers (:mod:`~foundrymix.loader.span`)."""
        stream_map = self._maps[stage.index]
        try:  # a stage's storage is built here at a switch: a failure is agreed on like a read's
            batches = iter(self._span_loader(stage, position, end))
        except Exception as e:
            self._agree(e)
            raise  # (_agree raised it: here for the reader)
        while True:
            failure: Optional[BaseException] = None
            try:
                batch = next(batches)
            except StopIteration:
                return  # every rank's span ends at the same batch
            except Exception as e:
                failure = e
            self._agree(failure)
            batch['stream_id'] = stream_map[batch['stream_id']]
            if self.run.explicit:
                batch['stage_id'] = torch.full_like(batch['stream_id'], stage.index)
            position.batch += 1
            yield batch

    def _span_loader(self, stage: StagePlan, position: StagedPosition, end: int) -> DataLoader:
        """The DataLoader of batches ``[position, end)`` of ``stage`` (its storage built if new)."""
        from foundrymix.loader.span import Span, span_loader
        from foundrymix.plan.topology import env_rank
        active = self._activate(stage)
        config = stage.config
        assert config is not None
        controller = position.adaptive.get(stage.index)
        offsets = np.asarray(active.store.sample_offset_per_stream, np.int64)
        if controller is not None:
            batch_rows = _segment_rows(controller, position.batch, offsets)
        else:
            batch_rows = stage.plan.order.batch
        first = position.batch - stage.start_batch
        rank = env_rank() if self.rank is None else self.rank
        span = Span(active.store, batch_rows, first, end - stage.start_batch, rank,
                    stage.batch_size, offsets)
        return span_loader(span, config.num_workers, config.pin_memory, config.timeout,
                           config.prefetch_factor)

    def _agree(self, failure: Optional[BaseException]) -> None:
        """Raise ``failure`` -- after :attr:`stop_together`, which raises on every rank when
        any rank failed."""
        if self.stop_together is not None:
            self.stop_together(failure)
        if failure is not None:
            raise failure

    def _activate(self, stage: StagePlan) -> _Active:
        """The stage's storage, built from its plan once per stage."""
        from foundrymix.loader.mixer import build_store
        if self._active is not None and self._active.stage.index == stage.index:
            return self._active
        self.release()
        assert stage.config is not None
        self._active = _Active(stage, build_store(stage.config, stage.infos, stage.where))
        return self._active

    def release(self) -> None:
        """Drop the current stage's storage (its locks and cache claims), so a later stage
        (or run) may reuse its directories."""
        active, self._active = self._active, None
        if active is None or sys is None or sys.is_finalizing():
            # An iterator still held when the interpreter exits is closed during its
            # teardown, with module globals gone (late enough, this module's ``sys`` is None).
            return
        store = active.store
        del active
        gc.collect()  # a span's iterator (and any workers) first
        store.release()


def _segment_rows(controller: AdaptiveController, batch: int, offsets: np.ndarray) -> Any:
    """An adaptive segment's batches as (stream, row), decided before its first batch is read
    (the trainer fed the controller the loss of the segment before)."""
    k = controller.segment_of(batch)
    ids = controller.segment_ids(k).reshape(-1, controller.global_batch)
    _warn_repeats(controller, k)
    start = controller.segment_start(k) - controller.start_batch
    if [int(x) for x in offsets] != controller.offsets.tolist():
        raise RuntimeError(f'adaptive: the dataset numbers samples from {offsets.tolist()}, the '
                           f'plan from {controller.offsets.tolist()}')

    def rows(b: int) -> tuple[np.ndarray, np.ndarray]:
        got = ids[b - start]
        streams = controller.stream_of(got)
        return streams, got - offsets[streams]
    return rows


#: an adaptive stream read this many times over is warned about (then at each doubling)
REPEAT_WARNING = 10


def _warn_repeats(controller: AdaptiveController, k: int) -> None:
    """Warn when the policy's weights have a stream read :data:`REPEAT_WARNING` times over
    (then 2x, 4x that, ...) by the end of segment ``k``: the plan's passes hold for the
    configured start only, and a small stream a policy favours is repeated without end."""
    done = controller.consumed_before(k) + np.asarray(controller.decision(k).rows, np.int64)
    warned = controller.__dict__.setdefault('_repeat_warned', {})
    for name, n, rows in zip(controller.names, done.tolist(), controller.rows):
        passes = n / max(int(rows), 1)
        level = REPEAT_WARNING
        while level * 2 <= passes:
            level *= 2
        if passes >= REPEAT_WARNING and warned.get(name, 0) < level:
            warned[name] = level
            log.warning(f"adaptive: stream '{name}' ({rows:,} rows) has been read {passes:.1f} "
                        f'times over in the run\'s first {controller.segment_start(k + 1)} batches (the policy\'s '
                        f'weights; the plan\'s passes hold for the configured start only). If that '
                        f'is not wanted, add rows to it or leave it out of the adaptive stage')


def build_run_loader(run: RunPlan, batch_size: int, composer_epochs: bool = False,
                     rank: Optional[int] = None) -> StagedDataLoader:
    """The loader of a planned run (``run`` from :func:`~foundrymix.plan.stages.plan_run`)
    for global rank ``rank`` (default: the launcher's)."""
    return StagedDataLoader(run, batch_size, composer_epochs, rank)


def build_staged_loader(config: Any, batch_size: int, max_duration: Optional[str] = None,
                        topology: Any = None, where: str = 'train_loader',
                        composer_epochs: bool = False) -> StagedDataLoader:
    """Validate every stage, plan the run, and return its loader (``loader.run`` is the plan)."""
    from foundrymix.plan.stages import plan_run

    run, _ = plan_run(config, batch_size, max_duration, topology, where, rank_count_limit=0)
    return build_run_loader(run, batch_size, composer_epochs)

