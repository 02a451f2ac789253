"""The run's one loader: every stage's batches in the plan's order, switched at exact batches.
A plain stateful iterable (``__iter__``, ``__len__``, ``state_dict``, ``load_state_dict``), not a
torch ``DataLoader``, so a trainer that rebuilds DataLoaders (accelerate, Lightning) passes it
through unchanged. Its state is the run's position (:mod:`foundrymix.loader.position`); its
iterator reads spans (:mod:`foundrymix.loader.span`), so a resume at any batch, on any number of
ranks with the same global batch, replays nothing."""

from __future__ import annotations

import atexit
import logging
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import torch

from foundrymix.config import ConfigError
from foundrymix.loader.position import StagedPosition
from foundrymix.loader.storage import build_store
from foundrymix.plan.adaptive import AdaptiveController
from foundrymix.plan.stages import RunPlan, StagePlan, build_run_plan, plan_run
from foundrymix.loader.span import Span, span_loader
from foundrymix.plan.topology import Topology, env_rank

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from foundrymix.plan.catalog import Catalog
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.topology import Topology

log = logging.getLogger(__name__)


@dataclass
class _Active:
    stage: StagePlan
    store: Any


class StagedDataLoader:
    """Rank ``rank``'s rows of every global batch of ``run``, from the position to the end;
    ``stream_id`` is the run-wide stream index and, in a run with ``stages:``, ``stage_id`` the
    stage of each sample. ``rewind``: every iteration starts at the first batch (an evaluation
    set)."""

    def __init__(self, run: RunPlan, rank: Optional[int] = None, rewind: bool = False) -> None:
        self.run = run
        self.rank = rank  #: whose rows of each global batch (default: the launcher's ``RANK``)
        self.rewind = rewind
        self.position = StagedPosition(run)
        self.stream_names = run.stream_names
        column = {n: i for i, n in enumerate(self.stream_names)}  # list.index: O(N^2) at 10,000 streams
        self._maps = [torch.tensor([column[n] for n in s.stream_names]) for s in run.stages]
        self._active: Optional[_Active] = None
        self._open = 0  # iterators of this loader started and not finished or closed

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
        return self.position.rows_per_stream()

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
        """The position: what a checkpoint keeps, plain Python values."""
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a :meth:`state_dict`'s batch (the trained past checked unchanged); refused
        while an iterator of this loader is open, which would go on from its own batch."""
        if self._open:
            raise ConfigError('load_state_dict: an iterator of this loader is open and would go on from '
                              'its own batch; load the state before iterating (or finish or close the '
                              'iterator first)')
        self.release()
        self.position.load_state_dict(state)

    def __len__(self) -> int:
        """The run's global batches (this rank yields its rows of each)."""
        return self.run.total_batches

    def __iter__(self) -> Iterator[Any]:
        if self.rewind:
            self.position.batch = 0
        return self.batches()

    def batches(self, end: Optional[int] = None) -> Iterator[Any]:
        """This rank's batches from the position up to global batch ``end`` (default: the run's
        end); the position counts each batch as it is yielded. One left open is closed at exit."""
        batches = self._batches(end)
        _OPEN.add(batches)
        return batches

    def _batches(self, end: Optional[int]) -> Iterator[Any]:
        position = self.position
        end = self.run.total_batches if end is None else min(end, self.run.total_batches)
        self._open += 1
        try:
            while position.batch < end:
                stage = self.run.stage_at(position.batch)
                yield from self._span(stage, position, min(end, self._span_end(stage, position)))
        finally:
            self._open -= 1

    def _span_end(self, stage: StagePlan, position: StagedPosition) -> int:
        """The end of the span from the position: the stage's, or the adaptive segment's (the
        next is decided from the loss)."""
        end = stage.end_batch
        controller = position.adaptive.get(stage.index)
        if controller is not None:
            k = controller.spec.segment_of(position.batch)
            end = min(end, controller.spec.segment_start(k) + controller.spec.segment_batches(k))
        return end

    def _span(self, stage: StagePlan, position: StagedPosition, end: int) -> Iterator[Any]:
        stream_map = self._maps[stage.index]
        for batch in self._span_loader(stage, position, end):
            ids = batch['stream_id']  # in place: a pinned batch stays pinned
            ids.copy_(stream_map[ids])
            if self.run.explicit:
                stage_id = torch.full_like(ids, stage.index)
                batch['stage_id'] = stage_id.pin_memory() if ids.is_pinned() else stage_id
            position.batch += 1
            yield batch

    def _span_loader(self, stage: StagePlan, position: StagedPosition, end: int) -> 'DataLoader':
        """The DataLoader of batches ``[position, end)`` of ``stage`` (its storage built if new)."""
        active = self._activate(stage)
        config = stage.config
        assert config is not None
        controller = position.adaptive.get(stage.index)
        order = position.order(stage)
        batch_rows = order.batch if controller is None else _segment_rows(controller, position.batch, order.start)
        rank = env_rank() if self.rank is None else self.rank
        span = Span(active.store, batch_rows, position.batch - stage.start_batch,
                    end - stage.start_batch, rank, stage.batch_size)
        return span_loader(span, config.num_workers, config.pin_memory, config.timeout,
                           config.prefetch_factor)

    def _activate(self, stage: StagePlan) -> _Active:
        """The stage's storage, built from its plan once per stage."""
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


#: the iterators not yet finished or closed, closed at exit while every module is whole: closed
#: later, in the interpreter's teardown, their prefetch threads' shutdown met ``queue`` gone
#: (``AttributeError: 'NoneType' object has no attribute 'Empty'``)
_OPEN: 'weakref.WeakSet[Iterator[Any]]' = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for batches in list(_OPEN):
        batches.close()


def build_run_loader(config: 'LoaderConfig', batch_size: int, max_duration: Optional[str] = None,
                     topology: Optional['Topology'] = None, *, where: str = 'train_loader',
                     rank: Optional[int] = None, rewind: bool = False,
                     catalogs: Optional[list['Catalog']] = None
                     ) -> tuple[StagedDataLoader, list['Catalog']]:
    """Plan a run and build its loader for global rank ``rank`` (default: the launcher's), with
    ``batch_size`` rows per rank; returns the loader and each stage's catalog. Every way to get a
    run's loader (``build_loader``, ``StreamMixer``, the trainer) comes here, so one config gives
    one plan and one order. ``catalogs``: a run without stages' catalog, already read (its
    metadata is not read again). Reads no rows: the first batch (or :meth:`prepare`) does."""
    topology = topology or Topology()
    if catalogs is None:
        run, catalogs = plan_run(config, batch_size, max_duration, topology, where, rank_count_limit=0)
    else:
        for catalog in catalogs:
            catalog.validate()
        run = build_run_plan(config, [c.infos() for c in catalogs], batch_size, max_duration,
                             topology, where, rank_count_limit=0)
    return StagedDataLoader(run, rank, rewind), catalogs


def _segment_rows(controller: AdaptiveController, batch: int, start: np.ndarray) -> Any:
    """An adaptive segment's batches as (stream, row), decided before its first batch is read
    (``start``: the streams' draws earlier stages took); the store alone turns them into sample
    ids (:class:`~foundrymix.loader.span.Span`)."""
    spec = controller.spec
    k = spec.segment_of(batch)
    streams, rows = (a.reshape(-1, spec.global_batch) for a in controller.segment_rows(k, start))
    _warn_repeats(controller, k)
    first = spec.segment_start(k) - spec.start_batch
    return lambda b: (streams[b - first], rows[b - first])


#: an adaptive stream read this many times over is warned about (then at each doubling)
REPEAT_WARNING = 10


def _warn_repeats(controller: AdaptiveController, k: int) -> None:
    """Warn when the policy's weights have read a stream :data:`REPEAT_WARNING` times over (then
    2x, 4x that, ...) by the end of segment ``k``: a small favoured stream repeats without end."""
    spec = controller.spec
    done = controller.consumed_before(k) + np.asarray(controller.decision(k).rows, np.int64)
    warned = controller.repeat_warned
    for name, n, rows in zip(spec.names, done.tolist(), spec.rows):
        passes = n / max(int(rows), 1)
        level = REPEAT_WARNING
        while level * 2 <= passes:
            level *= 2
        if passes >= REPEAT_WARNING and warned.get(name, 0) < level:
            warned[name] = level
            log.warning(f"adaptive: stream '{name}' ({rows:,} rows) has been read {passes:.1f} "
                        f'times over in the run\'s first {spec.segment_start(k + 1)} batches (the policy\'s '
                        f'weights; the plan\'s passes hold for the configured start only). If that '
                        f'is not wanted, add rows to it or leave it out of the adaptive stage')

