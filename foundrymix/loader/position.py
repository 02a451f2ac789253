"""The run's position -- the next global batch and what each trained stage was: what a checkpoint
keeps of the data. On resume, trained stages keep their data (fingerprint, global batch included),
start and trained length; later stages may change and new ones be appended (docs/resume.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from foundrymix.config import ConfigError
from foundrymix.plan.adaptive import AdaptiveController
from foundrymix.plan.order import StageOrder
from foundrymix.plan.stages import RunPlan, StagePlan, fingerprint_changes


#: version of :meth:`StagedPosition.state_dict`; 4: seed-free whole rows, passes across stages
POSITION_VERSION = 4


@dataclass
class Resumed:
    """What a resume found, for the resume line: where, and what the checkpoint's run was."""

    batch: int
    old_total_batches: Optional[int]   # None: the checkpoint did not record it
    old_total_samples: Optional[int] = None  # None: the checkpoint did not record it


class StagedPosition:
    """The next global batch to yield, and each adaptive stage's controller (its run state,
    made here per loader from the plan's spec: its decisions are state a checkpoint keeps)."""

    def __init__(self, run: RunPlan) -> None:
        self.run = run
        self.batch = 0  # next global batch to yield
        self.resumed: Optional[Resumed] = None
        #: stage index -> its adaptive controller (stages with ``adaptive:``)
        self.adaptive: dict[int, AdaptiveController] = {
            stage.index: AdaptiveController(stage.adaptive) for stage in run.stages if stage.adaptive}

    def order(self, stage: StagePlan) -> StageOrder:
        """The stage's order, its streams' draws taken from where earlier stages left them: the
        plan's start plus the rows earlier adaptive stages decided during the run (all decided
        before ``stage``'s first batch), so a stream's pass goes on after an adaptive stage too."""
        o, start = stage.order, stage.order.start.copy()
        for k, j, m in stage.after_adaptive:
            start[k] += self.adaptive[j].consumed_before(self.adaptive[j].spec.segments)[m]
        return StageOrder(o.draws, o.counts, o.global_batch, o.key, o.shuffle, start) if stage.after_adaptive else o

    def rows_per_stream(self) -> dict[str, int]:
        """Run-wide stream name -> rows of it in global batches before the position (all ranks),
        by arithmetic on the plan and the adaptive stages' decisions: a resumed loader, on any
        number of ranks, reports every rank's rows trained before it."""
        out = dict.fromkeys(self.run.stream_names, 0)
        for stage in self.run.stages:
            if stage.start_batch >= self.batch:
                break
            done = min(self.batch, stage.end_batch) - stage.start_batch
            controller = self.adaptive.get(stage.index)
            if controller is None:
                counts = self.order(stage).trained(done)
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

    def state_dict(self) -> dict[str, Any]:
        """The batch, each trained stage's fingerprint and the adaptive decisions: plain values."""
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
        version = check_state(obj)
        if version < POSITION_VERSION:
            raise ConfigError(
                'the checkpoint was written by an older foundrymix, whose sample order was '
                "streaming's sampler: it cannot be resumed by this version (the order is now "
                "foundrymix's own); start the run again, or finish it with the version that wrote it"
                if version < 3 else
                f'the checkpoint was written by an older foundrymix (data position version {version}), '
                f"whose rows per stream depended on the shuffle seed and whose stages restarted a reused "
                f"stream's passes; this version trains other rows from the same config, so it cannot "
                f'resume it: start the run again, or finish it with the version that wrote it')
        batch = int(obj['batch'])
        if batch > self.run.total_batches:
            raise ConfigError(
                f'the checkpoint is at batch {batch}, beyond the {self.run.total_batches} batches '
                f'this config trains: a run cannot be shortened below what it trained (give '
                f'max_duration / the stages at least {batch} batches)')
        self._check_order(obj, batch)
        for old in obj['stages']:  # the stages trained: starting before the batch
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
        """The last trained stage's global batch, checked first with a message saying how to
        resume (the fingerprints would only list it among other changes)."""
        trained = obj['stages']
        if not trained:
            return
        old_g = trained[-1]['fingerprint']['global_batch_size']
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
        trained = min(batch - old['start_batch'], old['batches'])
        if new.batches < trained:  # a stage may grow (a later trained stage would move: refused above)
            done = (f'finished with {old["batches"]} batches, now {new.batches}' if finished else
                    f'now {new.batches} batches, but the checkpoint already trained {trained} of it')
            raise ConfigError(f'{where}: {done}; what is trained cannot be undone')
        changes = fingerprint_changes(old['fingerprint'], new.fingerprint)
        if changes:
            if any(c.startswith('passes_after_adaptive') for c in changes):
                raise ConfigError(
                    f'{where}: the checkpoint is from a foundrymix that started a fresh pass of a '
                    f'stream after an adaptive stage; this one goes on with the pass, so this stage '
                    f'would train other rows. Resume it with the foundrymix that wrote it, or start '
                    f'the run afresh into a new save_folder (without load_path or autoresume)')
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


def check_state(obj: Any) -> int:
    """The version of a loader state, after refusing in one line anything that is not one this
    version can read: not a dict, a key missing or of the wrong type, a future version, trained
    stages that do not follow each other from batch 0, a batch that disagrees with its place in
    the last of them (what ``state_dict`` writes always agrees: an edit or another program's
    state does not)."""
    def fail(what: str) -> ConfigError:
        return ConfigError(f'loader state: {what}; pass what a foundrymix loader\'s state_dict() returned '
                           f'(checkpoint[...] as saved), unedited')

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)
    if not isinstance(obj, dict):
        raise fail(f'a dict is needed, got {type(obj).__name__}')
    version = obj.get('version', 0 if 'sample_in_epoch' in obj else None)  # 0: streaming's own state
    if not whole(version):
        raise fail(f"'version' must be an integer, got {version!r}")
    if version > POSITION_VERSION:
        raise ConfigError(f'loader state: written by a newer foundrymix (data position version {version}; '
                          f'this one reads {POSITION_VERSION}): resume with the version that wrote it')
    if version < POSITION_VERSION:
        return version
    for key in ('batch', 'batch_in_stage', 'stages'):
        if key not in obj:
            raise fail(f'no {key!r} (keys: {", ".join(map(str, obj))})')
    for key in ('batch', 'batch_in_stage', 'total_batches', 'total_samples', 'global_batch_size'):
        if not whole(obj.get(key)) and not (key.startswith(('total', 'global')) and obj.get(key) is None):
            raise fail(f'{key!r} must be an integer, got {obj.get(key)!r}')
    for key, kind in (('stages', list), ('adaptive', dict)):
        if not isinstance(obj.get(key, kind()), kind):
            raise fail(f'{key!r} must be a {kind.__name__}, got {obj[key]!r}')
    batch, inside, stages = obj['batch'], obj['batch_in_stage'], obj['stages']
    if batch < 0 or not 0 <= inside <= batch:
        raise fail(f'batch {batch} with batch_in_stage {inside}: both must be >= 0, the second at most the first')
    end = 0  # trained stages follow each other from batch 0, each of at least one batch
    for k, stage in enumerate(stages):
        fp = stage.get('fingerprint') if isinstance(stage, dict) else None
        if not (isinstance(fp, dict) and isinstance(stage.get('name'), str)
                and (whole(fp.get('global_batch_size')) or fp.get('global_batch_size', 0) is None)
                and isinstance(fp.get('knobs'), dict) and isinstance(fp.get('streams'), dict)
                and all(isinstance(v, dict) for v in fp['streams'].values())
                and all(whole(stage.get(key)) for key in ('start_batch', 'batches'))):
            raise fail(f'stages[{k}] must hold name, start_batch, batches and fingerprint')
        if stage['start_batch'] != end or stage['batches'] < 1 or stage['start_batch'] >= batch:
            raise fail(f'stages[{k}] ({stage["name"]!r}) starts at batch {stage["start_batch"]} with '
                       f'{stage["batches"]} batches: trained stages start where the one before ends (at '
                       f'{end}), each before the batch ({batch}) and with at least one batch')
        end += stage['batches']
    start = batch - inside  # of the stage at the position: the last trained one, or the next
    if inside and start not in {s['start_batch'] for s in stages}:
        raise fail(f'batch {batch} is batch {inside} of a stage starting at {start}, which no '
                   f'trained stage does')
    if inside and (start != stages[-1]['start_batch'] or inside > stages[-1]['batches']):
        raise fail(f'batch {batch} is batch {inside} of the stage starting at {start}, but the last trained '
                   f'stage, {stages[-1]["name"]!r}, is batches {stages[-1]["start_batch"]} to {end - 1}')
    if not inside and batch != end:
        raise fail(f'batch {batch} starts a stage, but the trained stages end at batch {end}')
    return version


def _weights_yaml(fingerprint: dict[str, Any]) -> str:
    """A fingerprint's stream weights as a YAML flow mapping: ``{a: {repeat: 1.0}, ...}``."""
    parts = []
    for name, stream in fingerprint['streams'].items():
        weights = ', '.join(f'{k}: {stream[k]}' for k in ('repeat', 'proportion', 'choose')
                            if stream.get(k) is not None)
        parts.append(f'{name}: {{{weights}}}')
    return '{' + ', '.join(parts) + '}'


def check_resume(obj: dict[str, Any], global_batch_size: Optional[int]) -> None:
    """Refuse a checkpointed data position made with another global batch size (a
    :class:`~foundrymix.config.ConfigError` naming both values)."""
    old_g = obj.get('global_batch_size')
    if old_g is not None and global_batch_size is not None and old_g != global_batch_size:
        raise ConfigError(
            f'global_train_batch_size: the checkpoint was trained with a global batch of '
            f'{old_g} rows, this run has {global_batch_size}; the epoch and every batch are made '
            f'of global batches, so it must stay fixed across a resize (the per-rank batch is '
            f'global_train_batch_size / ranks). Set global_train_batch_size: {old_g} to resume')
