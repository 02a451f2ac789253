"""One DataLoader for a whole staged run: each stage's mixture, switched at its exact batch.

Why one loader and one Composer ``fit``: the LR schedule, the optimizer and the
checkpoints belong to the whole run, and Composer checkpoints the train loader's
``dataset.state_dict``. Successive ``fit(duration=...)`` calls would stretch
``max_duration`` (and the schedule) stage by stage. So :class:`StagedDataLoader` is a
``torch.utils.data.DataLoader`` whose ``dataset`` is a :class:`StagedPosition` -- the
run's position (global batch), what Composer saves and loads -- and whose iterator
builds each stage's :class:`~foundrymix.mix.dataset.MixedDataset` in turn, yields
exactly the planned number of batches from it (whole epochs of the stage's mixture,
each reshuffled by streaming, then the rest of one), and drops it before the next stage
starts: streaming refuses two live datasets over one local directory, and a stream
reused by a later stage must still work.

The position counts batches *yielded to the trainer*, so a checkpoint names the next
batch exactly, whatever Composer thinks an epoch is (the whole run is one Composer
epoch). Resuming sets the stage's dataset to (epoch, sample in epoch) computed from that
batch, which streaming resumes exactly.

Rules for changing the data on resume (checked by :meth:`StagedPosition.load_state_dict`):
what has been trained is immutable -- stages already finished and the current stage
must have the same data definition (:func:`~foundrymix.mix.stages.stage_fingerprint`)
and the same start batch; later stages may change and new ones may be appended.
"""

from __future__ import annotations

import gc
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from foundrymix.config import ConfigError
from foundrymix.mix.mixer import StreamMixer
from foundrymix.mix.stages import RunPlan, fingerprint_changes


class StagedPosition(IterableDataset):
    """The staged run's position: the next global batch, and what each stage was.

    Composer finds it as ``train_dataloader.dataset`` and checkpoints it through
    :meth:`state_dict` / :meth:`load_state_dict`.
    """

    def __init__(self, run: RunPlan, fingerprints: list[dict[str, Any]]) -> None:
        self.run = run
        self.fingerprints = fingerprints
        self.batch = 0  # next global batch to yield

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - the loader iterates, not this
        raise TypeError('iterate the StagedDataLoader, not its position')

    def state_dict(self, num_samples: int = 0, from_beginning: bool = True) -> dict[str, Any]:
        stage = self.run.stage_at(self.batch)
        done = [s for s in self.run.stages if s.start_batch <= self.batch]
        epoch, in_epoch = divmod(self.batch - stage.start_batch, stage.plan.batches_per_epoch)
        return {
            'batch': self.batch,
            'stage': stage.index,
            'stage_name': stage.name,
            'batch_in_stage': self.batch - stage.start_batch,
            # the stage dataset's position, as streaming resumes it
            'stage_dataset': {'epoch': epoch,
                              'sample_in_epoch': in_epoch * stage.plan.global_batch_size},
            'stages': [{'name': s.name, 'start_batch': s.start_batch, 'batches': s.batches,
                        'fingerprint': self.fingerprints[s.index]} for s in done],
        }

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume at ``obj['batch']`` after checking that the trained past is unchanged."""
        batch = int(obj['batch'])
        if batch > self.run.total_batches:
            raise ConfigError(f'checkpoint is at batch {batch}, beyond the {self.run.total_batches} '
                              f'batches of the stages now configured')
        for old in obj['stages']:
            self._check_unchanged(old, batch)
        self.batch = batch

    def _check_unchanged(self, old: dict[str, Any], batch: int) -> None:
        name = old['name']
        new = next((s for s in self.run.stages if s.name == name), None)
        where = f'train_loader.stages ({name})'
        if new is None:
            raise ConfigError(f'{where}: stage {name!r} was trained up to batch {batch} and is gone '
                              f'from the config; trained stages cannot be removed or renamed')
        if new.start_batch != old['start_batch']:
            raise ConfigError(f'{where}: starts at batch {new.start_batch}, the checkpoint trained '
                              f'it from batch {old["start_batch"]}; earlier stages changed length')
        finished = old['start_batch'] + old['batches'] <= batch
        if finished and new.batches != old['batches']:
            raise ConfigError(f'{where}: finished with {old["batches"]} batches, now '
                              f'{new.batches}; a finished stage cannot change')
        if not finished and new.batches < batch - new.start_batch:
            raise ConfigError(f'{where}: now {new.batches} batches, but the checkpoint already '
                              f'trained {batch - new.start_batch} of it')
        changes = fingerprint_changes(old['fingerprint'], self.fingerprints[new.index])
        if changes:
            raise ConfigError(
                f'{where}: its data changed since the checkpoint ({"; ".join(changes)}); what is '
                f'trained cannot change. To change the mixture from here, end this stage at the '
                f'resume batch (duration: {batch - new.start_batch}ba) and add a new stage')


class StagedDataLoader(DataLoader):
    """Batches of every stage in order; ``stream_id`` is the run-wide stream index and
    ``stage_id`` the stage of each sample."""

    def __init__(self, run: RunPlan, mixers: list[StreamMixer], fingerprints: list[dict[str, Any]],
                 batch_size: int, stream_names: list[str]) -> None:
        super().__init__(StagedPosition(run, fingerprints), batch_size=batch_size)
        self.run = run
        self.mixers = mixers
        self.stream_names = stream_names
        self._maps = [torch.tensor([stream_names.index(n) for n in m.stream_names])
                      for m in mixers]

    def __len__(self) -> int:
        return self.run.total_batches

    def __iter__(self) -> Iterator[Any]:
        position: StagedPosition = self.dataset  # type: ignore[assignment]
        while position.batch < self.run.total_batches:
            stage = self.run.stage_at(position.batch)
            yield from self._stage_batches(stage.index, position)

    def _stage_batches(self, index: int, position: StagedPosition) -> Iterator[Any]:
        stage = self.run.stages[index]
        mixer = self.mixers[index]
        dataset = mixer.build_dataset(self.batch_size)
        done = position.batch - stage.start_batch
        bpe = stage.plan.batches_per_epoch
        epoch, in_epoch = divmod(done, bpe)
        if done:
            dataset.load_state_dict({
                'epoch': epoch, 'sample_in_epoch': in_epoch * stage.plan.global_batch_size,
                'num_canonical_nodes': dataset.num_canonical_nodes,
                'shuffle_seed': mixer.config.shuffle_seed, 'initial_physical_nodes': None})
        loader: Optional[Any] = mixer.build_dataloader(self.batch_size, dataset)
        stream_map = self._maps[index]
        try:
            while position.batch < stage.end_batch:
                yielded = 0
                for batch in loader:
                    batch['stream_id'] = stream_map[batch['stream_id']]
                    batch['stage_id'] = torch.full_like(batch['stream_id'], index)
                    position.batch += 1
                    yielded += 1
                    yield batch
                    if position.batch >= stage.end_batch:
                        break
                if not yielded:
                    raise RuntimeError(f'stage {stage.name}: an epoch yielded no batch')
        finally:
            loader = None
            gc.collect()  # the loader's iterator (and any workers) first
            dataset.release()  # then the stage's shared memory: a later stage may reuse its dirs
            del dataset


def build_staged_loader(config: Any, batch_size: int, max_duration: Optional[str] = None,
                        topology: Any = None, where: str = 'train_loader') -> StagedDataLoader:
    """Validate every stage, plan the run, and return its loader (``loader.run`` is the plan)."""
    from foundrymix.mix.stages import plan_run, stage_fingerprint

    run, catalogs = plan_run(config, batch_size, max_duration, topology, where)
    world = topology.world_size if topology is not None else 1
    fingerprints = [stage_fingerprint(c.config, c.infos(), batch_size * world) for c in catalogs]
    mixers = [StreamMixer(c.config, c.where) for c in catalogs]
    names: list[str] = []
    for mixer in mixers:
        names += [n for n in mixer.stream_names if n not in names]
    return StagedDataLoader(run, mixers, fingerprints, batch_size, names)
