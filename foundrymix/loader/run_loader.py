"""The run's one loader: every stage's batches in the plan's order, switched at exact batches.
A plain stateful iterable (``__iter__``, ``__len__``, ``state_dict``, ``load_state_dict``), not a
torch ``DataLoader``, so a trainer that rebuilds DataLoaders (accelerate, Lightning) passes it
through unchanged. Its state is the run's position (:mod:`foundrymix.loader.position`); its
iterator reads spans (:class:`Span`), so a resume at any batch, on any number of
ranks with the same global batch, replays nothing."""

from __future__ import annotations

import atexit
import logging
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from foundrymix.config import ConfigError
from foundrymix.format import streaming_format
from foundrymix.loader.collate import collate
from foundrymix.loader.position import StagedPosition
from foundrymix.loader.storage import build_store
from foundrymix.plan.adaptive import AdaptiveController
from foundrymix.plan.stages import RunPlan, StagePlan, build_run_plan, plan_run
from foundrymix.plan.topology import Topology, env_rank

if TYPE_CHECKING:
    from foundrymix.plan.catalog import Catalog
    from foundrymix.plan.config import LoaderConfig

log = logging.getLogger(__name__)


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
        self._stage: Optional[int] = None  # the stage whose storage is built
        #: the :class:`~foundrymix.loader.storage.RowStore` of the stage being read, or None
        #: before :meth:`prepare` / the first batch and after :meth:`release`
        self.storage: Any = None
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
        end = self.run.total_batches if end is None else min(end, self.run.total_batches)
        self._open += 1
        try:
            while self.position.batch < end:
                yield from self._span(self.run.stage_at(self.position.batch), end)
        finally:
            self._open -= 1

    def _span(self, stage: StagePlan, end: int) -> Iterator[Any]:
        """``stage``'s batches from the position up to ``end``, the stage's end or its adaptive
        segment's (the next is decided from the loss), by a DataLoader over a :class:`Span`."""
        position, store, config = self.position, self._activate(stage), stage.config
        assert config is not None
        end, order = min(end, stage.end_batch), position.order(stage)
        batch_rows = order.batch
        controller = position.adaptive.get(stage.index)
        if controller is not None:
            k = controller.spec.segment_of(position.batch)
            end = min(end, controller.spec.segment_start(k) + controller.spec.segment_batches(k))
            batch_rows = _segment_rows(controller, position.batch, order.start)
        rank = env_rank() if self.rank is None else self.rank
        span = Span(store, batch_rows, position.batch - stage.start_batch, end - stage.start_batch, rank,
                    stage.batch_size)
        stream_map = self._maps[stage.index]
        for batch in span_loader(span, config.num_workers, config.pin_memory, config.timeout, config.prefetch_factor):
            ids = batch['stream_id']  # in place: a pinned batch stays pinned
            ids.copy_(stream_map[ids])
            if self.run.explicit:
                stage_id = torch.full_like(ids, stage.index)
                batch['stage_id'] = stage_id.pin_memory() if ids.is_pinned() else stage_id
            position.batch += 1
            yield batch

    def _activate(self, stage: StagePlan) -> Any:
        """The stage's storage, built from its plan once per stage."""
        if self.storage is None or self._stage != stage.index:
            self.release()
            assert stage.config is not None
            self.storage = build_store(stage.config, stage.infos, stage.where)
            self._stage = stage.index
        return self.storage

    def release(self) -> None:
        """Drop the current stage's storage, its locks and cache claims given back."""
        store, self.storage = self.storage, None
        # an iterator closed in interpreter teardown: module globals (``sys``) may be gone
        if store is not None and sys is not None and not sys.is_finalizing():
            store.release()


#: the iterators not yet finished or closed, closed at exit while every module is whole: closed
#: later, in the interpreter's teardown, their prefetch threads' shutdown met ``queue`` gone
#: (``AttributeError: 'NoneType' object has no attribute 'Empty'``)
_OPEN: 'weakref.WeakSet[Iterator[Any]]' = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for batches in list(_OPEN):
        batches.close()


#: a worker's next batches whose shards are opened (fetched side by side) ahead of reading
PREFETCH_BATCHES = 8
PREFETCH_THREADS = 4

#: (global batch index within the stage) -> (stream index, row) of each of its rows
BatchRows = Callable[[int], tuple[np.ndarray, np.ndarray]]


class Span(IterableDataset):
    """Global batches ``[first, end)`` of one stage: rank ``rank``'s ``batch_size`` rows of each,
    read from ``storage`` by sample id and collated in DataLoader workers. The order maps any batch
    to its rows (no sampler state), so resuming is starting a span there. A (stream, row) becomes
    an id by the store's own numbering, the one it reads by. Worker ``w`` of ``W`` reads batches
    ``first + w, first + w + W, ...``, in turn."""

    def __init__(self, storage: Any, batch_rows: BatchRows, first: int, end: int, rank: int,
                 batch_size: int) -> None:
        self.storage = storage
        self.batch_rows = batch_rows
        self.first, self.end = first, end
        self.rank, self.batch_size = rank, batch_size
        self.offsets = np.asarray(storage.sample_offset_per_stream, np.int64)

    def sample_ids(self, b: int) -> np.ndarray:
        """This rank's sample ids of stage batch ``b``."""
        streams, rows = self.batch_rows(b)
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return self.offsets[streams[mine]] + rows[mine]

    def __iter__(self) -> Iterator[Any]:
        """This worker's batches, the shards of the next ones opened in threads meanwhile."""
        info = get_worker_info()
        w, W = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(self.first + w, self.end, W)
        ahead = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix='foundrymix-prefetch')
        try:
            for k in range(min(PREFETCH_BATCHES, len(mine))):
                ahead.submit(self.storage.prefetch, self.sample_ids(mine[k]))
            for k, b in enumerate(mine):
                if k + PREFETCH_BATCHES < len(mine):
                    ahead.submit(self.storage.prefetch, self.sample_ids(mine[k + PREFETCH_BATCHES]))
                yield collate([self.storage.get_row(int(i)) for i in self.sample_ids(b)])
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)  # nothing runs on after the reader

    def __len__(self) -> int:
        return max(0, self.end - self.first)


def _as_is(batch: Any) -> Any:
    return batch


def span_loader(span: Span, num_workers: int, pin_memory: Optional[bool] = None, timeout: float = 0,
                prefetch_factor: Optional[int] = None) -> DataLoader:
    """A DataLoader over a span: collated batches in order; never more workers than batches,
    forked after streaming's format modules are imported here (else each imports streaming)."""
    workers = min(num_workers, len(span))
    extra = {'prefetch_factor': prefetch_factor} if workers > 0 and prefetch_factor is not None else {}
    if workers > 0:
        streaming_format.load()
    return DataLoader(span, batch_size=None, collate_fn=_as_is, num_workers=workers, timeout=timeout if workers else 0,
                      pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory, **extra)


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
    else:  # infos() validates each
        run = build_run_plan(config, [c.infos() for c in catalogs], batch_size, max_duration,
                             topology, where, rank_count_limit=0)
    return StagedDataLoader(run, rank, rewind), catalogs


def _segment_rows(controller: AdaptiveController, batch: int, start: np.ndarray) -> Any:
    """An adaptive segment's batches as (stream, row), decided before its first batch is read
    (``start``: the streams' draws earlier stages took); the store alone turns them into sample
    ids (:class:`Span`)."""
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

