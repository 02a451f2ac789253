"""The run's one DataLoader: every stage's batches in the plan's order, switched at exact batches.
Its ``dataset`` is the run's position (:mod:`foundrymix.loader.position`), what Composer saves and
loads; its iterator reads spans (:mod:`foundrymix.loader.span`), so a resume at any batch, on any
number of ranks with the same global batch, replays nothing."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from foundrymix.loader.position import StagedPosition
from foundrymix.plan.adaptive import AdaptiveController
from foundrymix.plan.stages import RunPlan, StagePlan

log = logging.getLogger(__name__)


@dataclass
class _Active:
    stage: StagePlan
    store: Any


class StagedDataLoader(DataLoader):
    """Batches of every stage in order; ``stream_id`` is the run-wide stream index and, in a
    run with ``stages:``, ``stage_id`` the stage of each sample."""

    def __init__(self, run: RunPlan, batch_size: int, composer_epochs: bool = False,
                 rank: Optional[int] = None) -> None:
        super().__init__(StagedPosition(run), batch_size=batch_size)
        self.run = run
        self.rank = rank  #: whose rows of each global batch (default: the launcher's ``RANK``)
        self.rewind = False  #: every iteration starts at the first batch (an evaluation set)
        #: called before each batch with this rank's failure or None (:mod:`~.together`)
        self.stop_together: Optional[Callable[[Optional[BaseException]], None]] = None
        if composer_epochs and (run.explicit or any(s.config is not None and s.config.adaptive
                                                    for s in run.stages)):
            # one Composer epoch: epochs ending at stage switches would be renumbered by a
            # resume exactly at a switch; an adaptive run has no epochs of one mixture
            composer_epochs = False
        self.composer_epochs = composer_epochs
        self.stream_names = run.stream_names
        column = {n: i for i, n in enumerate(self.stream_names)}  # list.index: O(N^2) at 10,000 streams
        self._maps = [torch.tensor([column[n] for n in s.stream_names]) for s in run.stages]
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
        """Stream name -> rows of it in all ranks' global batches before the position."""
        from foundrymix.plan.counts import rows_before
        return rows_before(self.run, self.position.batch, self.position.adaptive)

    @property
    def storage(self) -> Any:
        """The :class:`~foundrymix.loader.storage.RowStore` of the stage being read, or None
        before :meth:`prepare` / the first batch and after :meth:`release`."""
        return self._active.store if self._active is not None else None

    def prepare(self) -> None:
        """Build the storage of the stage at the position now: what refuses a run refuses it here."""
        if self.position.batch < self.run.total_batches:
            self._activate(self.run.stage_at(self.position.batch))

    def state_dict(self) -> dict[str, Any]:
        """The position: what a checkpoint keeps (Composer checkpoints the position itself)."""
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a :meth:`state_dict`'s batch (the trained past checked unchanged)."""
        self.release()
        self.position.load_state_dict(state)

    def __len__(self) -> int:
        """Batches of one iteration: the run, or (``composer_epochs``) one epoch of its mixture,
        which Composer's ``ep`` times are converted with."""
        if not self.composer_epochs:
            return self.run.total_batches
        return max(s.plan.batches_per_epoch for s in self.run.stages)

    def __iter__(self) -> Iterator[Any]:
        position = self.position
        if self.rewind:
            position.batch = 0
        while position.batch < self.run.total_batches:
            stage = self.run.stage_at(position.batch)
            yield from self._span(stage, position, self._span_end(stage, position))
            if self.composer_epochs and (position.batch - stage.start_batch) % \
                    stage.plan.batches_per_epoch == 0:
                return

    def _span_end(self, stage: StagePlan, position: StagedPosition) -> int:
        """The end of the span from the position: the stage's, the adaptive segment's (the next is
        decided from the loss), or with ``composer_epochs`` the epoch's."""
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
            ids = batch['stream_id']  # in place: a pinned batch stays pinned
            ids.copy_(stream_map[ids])
            if self.run.explicit:
                stage_id = torch.full_like(ids, stage.index)
                batch['stage_id'] = stage_id.pin_memory() if ids.is_pinned() else stage_id
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
        batch_rows = (stage.plan.order.batch if controller is None
                      else _segment_rows(controller, position.batch, offsets))
        rank = env_rank() if self.rank is None else self.rank
        span = Span(active.store, batch_rows, position.batch - stage.start_batch,
                    end - stage.start_batch, rank, stage.batch_size, offsets)
        return span_loader(span, config.num_workers, config.pin_memory, config.timeout,
                           config.prefetch_factor)

    def _agree(self, failure: Optional[BaseException]) -> None:
        """Raise ``failure``, after :attr:`stop_together` (which raises on every rank if any failed)."""
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
        """Drop the current stage's storage, its locks and cache claims given back."""
        active, self._active = self._active, None
        if active is None or sys is None or sys.is_finalizing():
            # an iterator closed in interpreter teardown: module globals (``sys``) may be gone
            return
        store = active.store
        del active
        store.release()


def _segment_rows(controller: AdaptiveController, batch: int, offsets: np.ndarray) -> Any:
    """An adaptive segment's batches as (stream, row), decided before its first batch is read."""
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
    """Warn when the policy's weights have read a stream :data:`REPEAT_WARNING` times over (then
    2x, 4x that, ...) by the end of segment ``k``: a small favoured stream repeats without end."""
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
    """The loader of a planned run for global rank ``rank`` (default: the launcher's)."""
    return StagedDataLoader(run, batch_size, composer_epochs, rank)

