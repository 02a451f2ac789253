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

Rules for changing the data on resume (checked by :meth:`StagedPosition.load_state_dict`):
what has been trained is immutable -- stages already (partly) trained must have the same
data definition (:func:`~foundrymix.plan.stages.stage_fingerprint`, their global batch
included) and the same start batch; a finished stage keeps its length. Later stages
(including one that starts exactly at the checkpoint) may change -- their
``global_train_batch_size`` too -- and new ones, with new streams, may be appended; the
run may be extended. Positions written in streaming's order (versions 1-2) are refused.
"""

from __future__ import annotations

import gc
import logging
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from foundrymix.config import ConfigError
from foundrymix.plan.adaptive import AdaptiveController, build_controller
from foundrymix.plan.stages import RunPlan, StagePlan, fingerprint_changes

log = logging.getLogger(__name__)

#: version of :meth:`StagedPosition.state_dict`; 3: the order of :mod:`foundrymix.plan.order`
#: (checkpoints of versions 1-2 and streaming's own dataset state followed streaming's sampler)
POSITION_VERSION = 3


@dataclass
class Resumed:
    """What a resume found, for the resume line: where, and what the checkpoint's run was."""

    batch: int
    old_total_batches: Optional[int]   # None: the checkpoint did not record it
    legacy: bool = False               # a single-mixture checkpoint from before fingerprints
    old_total_samples: Optional[int] = None  # None: the checkpoint did not record it


class StagedPosition(IterableDataset):
    """The run's position: the next global batch, and what each trained stage was.

    Composer finds it as ``train_dataloader.dataset`` and checkpoints it through
    :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self, run: RunPlan) -> None:
        self.run = run
        self.batch = 0  # next global batch to yield
        self.resumed: Optional[Resumed] = None
        #: stage index -> its adaptive controller (stages with ``adaptive:``)
        self.adaptive: dict[int, AdaptiveController] = {}
        for stage in run.stages:
            controller = build_controller(stage)
            if controller is not None:
                self.adaptive[stage.index] = controller

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - the loader iterates, not this
        raise TypeError('iterate the StagedDataLoader, not its position')

    def state_dict(self, num_samples: int = 0, from_beginning: bool = True) -> dict[str, Any]:
        stage = self.run.stage_at(self.batch)
        # stages with at least one batch trained: their data is now immutable
        done = [s for s in self.run.stages if s.start_batch < self.batch]
        return {
            'version': POSITION_VERSION,
            'batch': self.batch,
            'total_batches': self.run.total_batches,
            'total_samples': self.run.total_samples,
            # the global batch of the stage at the position (each stage has its own)
            'global_batch_size': stage.global_batch_size,
            'stage': stage.index,
            'stage_name': stage.name,
            'batch_in_stage': self.batch - stage.start_batch,
            'stages': [{'name': s.name, 'start_batch': s.start_batch, 'batches': s.batches,
                        'fingerprint': s.fingerprint} for s in done],
            # adaptive stages: the policy's state and every decision made so far
            'adaptive': {self.run.stages[i].name: c.state_dict()
                         for i, c in self.adaptive.items() if self.run.stages[i].start_batch <= self.batch},
        }

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume at ``obj['batch']`` after checking that the trained past is unchanged."""
        if int(obj.get('version', 0) if isinstance(obj, dict) else 0) < POSITION_VERSION:
            raise ConfigError(
                'the checkpoint was written by an older foundrymix, whose sample order was '
                "streaming's sampler: it cannot be resumed by this version (the order is now "
                "foundrymix's own); start the run again, or finish it with the version that wrote it")
        batch = int(obj['batch'])
        if batch > self.run.total_batches:
            raise ConfigError(
                f'the checkpoint is at batch {batch}, beyond the {self.run.total_batches} batches '
                f'this config trains: a run cannot be shortened below what it trained (give '
                f'max_duration / the stages at least {batch} batches)')
        self._check_order(obj, batch)
        for old in obj['stages']:
            if old['start_batch'] < batch:  # (older checkpoints also list a stage starting here)
                self._check_unchanged(old, batch)
        for index, controller in self.adaptive.items():
            state = obj.get('adaptive', {}).get(self.run.stages[index].name)
            if state is not None:
                controller.load_state_dict(state, batch)
        self.batch = batch
        total, samples = obj.get('total_batches'), obj.get('total_samples')
        self.resumed = Resumed(batch, int(total) if total is not None else None,
                               old_total_samples=int(samples) if samples is not None else None)

    def _check_order(self, obj: dict[str, Any], batch: int) -> None:
        """The global batch, which fixes every batch's rows, checked first with the message
        that says how to resume (a resize keeps it; the fingerprints would only list it among
        other changes).

        The global batch is the last trained stage's (each stage has its own): the stage the
        checkpoint is inside keeps it; a stage that starts at the checkpoint may set another.
        """
        from foundrymix.loader.storage import check_resume
        trained = [s for s in obj['stages'] if s['start_batch'] < batch]
        if not trained:
            return
        last = trained[-1]['fingerprint']
        # the stage's own batch (its fingerprint); older checkpoints: the run's, the same
        old_g = last.get('global_batch_size', obj.get('global_batch_size'))
        stage = next((s for s in self.run.stages if s.name == trained[-1]['name']), None)
        if stage is None:
            return  # a trained stage removed: _check_unchanged names it
        assert stage.config is not None
        if self.run.explicit and old_g is not None and old_g != stage.global_batch_size:
            done = batch - trained[-1]['start_batch']
            rest = ('' if done >= trained[-1]['batches'] else
                    f'; to change the batch from here, end the stage at the resume batch '
                    f'(duration: {done}ba) and add a stage after it with its own '
                    f'global_train_batch_size')
            raise ConfigError(
                f'{stage.where}.global_train_batch_size: the checkpoint trained '
                f'{min(done, trained[-1]["batches"])} batches of stage {stage.name!r} with a global '
                f'batch of {old_g} rows, this config gives it {stage.global_batch_size}; its epochs '
                f'and every batch are made of that batch, so a trained stage keeps it (stages that '
                f'start at or after the checkpoint may change theirs). Set '
                f'{stage.where}.global_train_batch_size: {old_g} to resume{rest}')
        check_resume({'global_batch_size': old_g}, stage.global_batch_size)

    def _check_unchanged(self, old: dict[str, Any], batch: int) -> None:
        name = old['name']
        new = next((s for s in self.run.stages if s.name == name), None)
        where = f'train_loader.stages ({name})' if self.run.explicit else 'train_loader'
        trained = batch - old['start_batch']
        if new is None:
            raise ConfigError(
                f'train_loader.stages: stage {name!r} was trained (batches {old["start_batch"]} to '
                f'{min(batch, old["start_batch"] + old["batches"]) - 1}) and is gone from the '
                f'config; trained stages cannot be removed or renamed'
                + (f' (a run without stages: is the one stage {name!r}: to add stages to it, make '
                   f'the first stage {{name: {name}, duration: {old["batches"]}ba}} with the same '
                   f'streams)' if not self.run.explicit or name == 'main' else ''))
        if new.start_batch != old['start_batch']:
            raise ConfigError(f'{where}: starts at batch {new.start_batch}, the checkpoint trained '
                              f'it from batch {old["start_batch"]}; earlier stages changed length')
        finished = old['start_batch'] + old['batches'] <= batch
        trained = min(trained, old['batches'])
        # A stage may grow (extending a finished run continues its mixture's epochs; a later
        # stage that was trained would move, which the start-batch check refuses) but never
        # shrink below what it trained.
        if new.batches < trained and finished:
            raise ConfigError(f'{where}: finished with {old["batches"]} batches, now '
                              f'{new.batches}; what is trained cannot be undone')
        if new.batches < trained:
            raise ConfigError(f'{where}: now {new.batches} batches, but the checkpoint already '
                              f'trained {trained} of it; what is trained cannot be undone')
        changes = fingerprint_changes(old['fingerprint'], new.fingerprint)
        if changes:
            if finished:
                advice = ('a finished stage is what the model was trained on; to train other data '
                          'from here, append a stage')
            elif self.run.explicit:
                advice = (f'to change the mixture from here, end this stage at the resume batch '
                          f'(duration: {trained}ba) and add a new stage after it')
            else:
                advice = (f'to change the mixture from here, make the trained part a stage and add '
                          f'one after it: stages: [{{name: {name}, duration: {trained}ba, streams: '
                          f'{_weights_yaml(old["fingerprint"])}}}, {{name: next, duration: ..., '
                          f'streams: <the new weights>}}], leave max_duration out (the run is the '
                          f'sum of the stages), and keep only locations (local/remote/split) in '
                          f'train_loader.streams')
            raise ConfigError(
                f'{where}: its data changed since the checkpoint ({"; ".join(changes)}); what '
                f'is trained cannot change (the checkpoint trained {trained} batches of it). '
                f'{advice[0].upper()}{advice[1:]}')


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
        stream_map = self._maps[stage.index]
        loader = span_loader(span, config.num_workers, config.pin_memory, config.timeout,
                             config.prefetch_factor)
        for batch in loader:
            batch['stream_id'] = stream_map[batch['stream_id']]
            if self.run.explicit:
                batch['stage_id'] = torch.full_like(batch['stream_id'], stage.index)
            position.batch += 1
            yield batch

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
    start = controller.segment_start(k) - controller.start_batch
    if [int(x) for x in offsets] != controller.offsets.tolist():
        raise RuntimeError(f'adaptive: the dataset numbers samples from {offsets.tolist()}, the '
                           f'plan from {controller.offsets.tolist()}')

    def rows(b: int) -> tuple[np.ndarray, np.ndarray]:
        got = ids[b - start]
        streams = controller.stream_of(got)
        return streams, got - offsets[streams]
    return rows


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

    run, _ = plan_run(config, batch_size, max_duration, topology, where)
    return build_run_loader(run, batch_size, composer_epochs)


def _weights_yaml(fingerprint: dict[str, Any]) -> str:
    """A fingerprint's stream weights as a YAML flow mapping: ``{a: {repeat: 1.0}, ...}``."""
    parts = []
    for name, stream in fingerprint['streams'].items():
        weights = ', '.join(f'{k}: {stream[k]}' for k in ('repeat', 'proportion', 'choose')
                            if stream.get(k) is not None)
        parts.append(f'{name}: {{{weights}}}')
    return '{' + ', '.join(parts) + '}'
