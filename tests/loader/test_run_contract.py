"""The run contract: one plan per run, the loader built from it, one resume rule for every run.

In-process (fast): the plan and the loader share one object -- each stage's epoch weights
are computed once and each stream's metadata read once, and the datasets the loader
builds get exactly those weights.

Real ``python train.py`` processes (slow): a run *without* stages refuses to resume on
changed data (another directory under the same stream name, another repeat, another
shuffle seed) and the advice it prints works when followed; appended stages may bring
streams the run never used; the next stage is editable from a checkpoint at a stage
boundary; a refused rerun leaves the finished run's files as they were; extending a
finished run prints what the LR schedule does; a single-mixture checkpoint from before
the contract (streaming's own dataset state) still resumes exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_run_config
from train_helpers import sample_log, train

BATCH = 4


@pytest.fixture(scope='module')
def data(small_streams) -> dict[str, str]:
    return {name: str(path) for name, path in small_streams.items()}


# ----------------------------------------------------------------- in-process: one plan
def _count_calls(monkeypatch) -> dict[str, int]:
    """Count epoch-weight computations and catalog metadata reads wherever they happen."""
    from foundrymix.plan import catalog, exact
    from foundrymix.plan import mixture as plan
    calls = {'weights': 0, 'reads': 0}
    weights, read = exact.epoch_weights, catalog.Catalog._read

    def counted_weights(*a, **k):
        calls['weights'] += 1
        return weights(*a, **k)

    def counted_read(self, name):
        calls['reads'] += 1
        return read(self, name)
    monkeypatch.setattr(exact, 'epoch_weights', counted_weights)
    monkeypatch.setattr(plan, 'epoch_weights', counted_weights)
    monkeypatch.setattr(catalog.Catalog, '_read', counted_read)
    return calls


@pytest.mark.parametrize('staged', [True, False], ids=['three-stages', 'no-stages'])
def test_plan_and_loader_share_one_plan(data, monkeypatch, staged):
    from foundrymix.loader import run_loader
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.loader.run_loader import StagedDataLoader
    from foundrymix.plan.stages import plan_run

    loader_cfg = {'streams': {'arxiv': {'local': data['arxiv']}, 'dolly': {'local': data['dolly']}},
                  'shuffle_seed': 3}
    if staged:
        loader_cfg['stages'] = [
            {'name': 'a', 'duration': '5ba', 'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.25}}},
            {'name': 'b', 'duration': '1ep', 'streams': {'dolly': {'repeat': 1}}},
            {'name': 'c', 'duration': '3ba', 'streams': {'arxiv': {'repeat': 0.5}, 'dolly': {'repeat': 0.5}}}]
        max_duration = None
    else:
        loader_cfg['streams']['arxiv']['repeat'] = 1.5
        max_duration = '2ep'
    calls = _count_calls(monkeypatch)
    run, _ = plan_run(LoaderConfig.from_dict(loader_cfg), BATCH, max_duration)
    n_stages = 3 if staged else 1
    assert calls == {'weights': n_stages, 'reads': 2}  # once per stage; each stream's files once
    built = []
    real_build = run_loader.build_store

    def spy(config, infos, *a, **k):
        built.append((config, infos))
        return real_build(config, infos, *a, **k)
    monkeypatch.setattr(run_loader, 'build_store', spy)  # what the loader builds each stage with
    loader = StagedDataLoader(run)
    batches = list(loader)
    assert calls == {'weights': n_stages, 'reads': 2}  # the loader recomputed and re-read nothing
    assert len(batches) == run.total_batches and loader.run is run
    assert len(built) == n_stages
    for stage, (config, infos) in zip(run.stages, built):
        assert config is stage.config and infos is stage.infos
    # ... and what it trained is what the plan says, per stage and stream
    names = loader.stream_names
    for stage in run.stages:
        got = Counter(names[i] for b in batches[stage.start_batch:stage.end_batch]
                      for i in b['stream_id'].tolist())
        assert dict(got) == stage.plan.duration.rows_per_stream


# ------------------------------------------------------------ real train.py processes
def plain_config(run: Path, data: dict[str, str], loader: dict | None = None, **top) -> Path:
    loader = loader or {'streams': {'arxiv': {'local': data['arxiv'], 'repeat': 1},
                                    'dolly': {'local': data['dolly'], 'repeat': 0.5}},
                        'shuffle_seed': 3, 'num_workers': 0}
    callbacks = {'sample_log': {'path': str(run / 'samples.jsonl')},
                 'stream_accounting': {'out_dir': str(run / 'report'), 'log_interval': '1ba'}}
    cfg = tiny_run_config(loader, run_name='contract', global_train_batch_size=BATCH,
                          max_duration='12ba', save_folder=str(run / 'ckpt'), callbacks=callbacks,
                          scheduler={'name': 'cosine_with_warmup', 't_warmup': '2ba', 'alpha_f': 0.1})
    cfg.update(top)
    path = run / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def latest(run: Path) -> str:
    return os.path.realpath(run / 'ckpt' / 'latest-rank0.pt')


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob('*')) if p.is_file()}


@pytest.mark.slow
def test_plain_run_refuses_changed_data_and_its_advice_works(tmp_path, data):
    cfg = plain_config(tmp_path, data, save_interval='4ba')
    train(cfg, 'callbacks.stop_at.time=4ba')
    ckpt = latest(tmp_path)
    first_four = sample_log(tmp_path / 'samples.jsonl')
    assert len(first_four) == 4
    other = tmp_path / 'arxiv-elsewhere'
    shutil.copytree(data['arxiv'], other)
    refusals = {
        f'train_loader.streams.arxiv.local={other}':
            f"stream arxiv: directory {data['arxiv']!r} -> {str(other)!r}",
        'train_loader.streams.arxiv.repeat=2': 'stream arxiv: repeat 1.0 -> 2.0',
        'train_loader.shuffle_seed=4': 'shuffle_seed 3 -> 4',
    }
    for override, change in refusals.items():
        proc = train(cfg, f'load_path={ckpt}', override, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f'train_loader: its data changed since the checkpoint ({change})' in proc.stderr
        recipe = 'stages: [{name: main, duration: 4ba, streams: {arxiv: {repeat: 1.0}, dolly: {repeat: 0.5}}}'
        assert recipe in proc.stderr
        assert sample_log(tmp_path / 'samples.jsonl') == first_four  # refused: nothing touched
    # The recipe, followed: the trained part becomes stage main (its weights copied from the
    # message), a new stage trains the new data; train_loader.streams keeps the locations.
    loader = yaml.safe_load(cfg.read_text())['train_loader']
    for stream in loader['streams'].values():
        stream.pop('repeat')
    loader['stages'] = [
        {'name': 'main', 'duration': '4ba', 'streams': yaml.safe_load(recipe[len('stages: [{name: main, duration: 4ba, streams: '):-1])},
        {'name': 'next', 'duration': '6ba', 'streams': {'elsewhere': {'local': str(other), 'repeat': 1}}}]
    staged = plain_config(tmp_path, data, loader=loader)
    doc = yaml.safe_load(staged.read_text())
    doc.pop('max_duration')
    staged.write_text(yaml.safe_dump(doc))
    proc = train(staged, f'load_path={ckpt}')
    log = sample_log(tmp_path / 'samples.jsonl')
    assert log[:4] == first_four and len(log) == 10
    report = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    streams = Counter(s for b in log for s in b['stream_ids'])
    names = list(report['streams'])
    assert names == ['arxiv', 'dolly', 'elsewhere']  # the run's stream set grew
    assert {n: report['streams'][n]['samples'] for n in names} == {n: streams[i] for i, n in enumerate(names)}
    assert all(s == 2 for b in log[4:] for s in b['stream_ids'])  # stage next: only the new stream


@pytest.mark.slow
def test_next_stage_is_editable_from_a_checkpoint_at_the_boundary(tmp_path, data):
    loader = {'streams': {'arxiv': {'local': data['arxiv']}, 'dolly': {'local': data['dolly']}},
              'shuffle_seed': 3, 'num_workers': 0,
              'stages': [{'name': 'one', 'duration': '4ba', 'streams': {'arxiv': {'repeat': 1}}},
                         {'name': 'two', 'duration': '4ba',
                          'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.25}}}]}
    cfg = plain_config(tmp_path, data, loader=loader, save_interval='4ba')
    doc = yaml.safe_load(cfg.read_text())
    doc.pop('max_duration')
    cfg.write_text(yaml.safe_dump(doc))
    train(cfg, 'callbacks.stop_at.time=4ba')
    # Stage two changes weights (and is renamed) at the checkpoint written as stage one ended.
    proc = train(cfg, f'load_path={latest(tmp_path)}', 'train_loader.stages.1.streams.dolly.repeat=1',
                 'train_loader.stages.1.name=two-b')
    assert 'stage' in proc.stdout
    from foundrymix.tools.plan import plan_from_yaml
    run = plan_from_yaml(str(cfg), ['train_loader.stages.1.streams.dolly.repeat=1',
                                    'train_loader.stages.1.name=two-b'])
    log = sample_log(tmp_path / 'samples.jsonl')
    two = run.stages[1]
    got = Counter(['arxiv', 'dolly'][s] for b in log[two.start_batch:two.end_batch] for s in b['stream_ids'])
    assert dict(got) == two.plan.duration.rows_per_stream


@pytest.mark.slow
def test_refused_rerun_leaves_the_finished_runs_files(tmp_path, data):
    cfg = plain_config(tmp_path, data, max_duration='6ba', save_interval='3ba')
    train(cfg)
    before = tree_digest(tmp_path)
    assert len(sample_log(tmp_path / 'samples.jsonl')) == 6
    proc = train(cfg, check=False)  # the same command again: its checkpoints exist
    assert proc.returncode != 0
    assert tree_digest(tmp_path) == before  # sample log, report and checkpoints as they were


@pytest.mark.slow
def test_extending_a_finished_run_says_what_the_schedule_does(tmp_path, data):
    cfg = plain_config(tmp_path, data, max_duration='6ba', save_interval='6ba')
    train(cfg)
    proc = train(cfg, 'max_duration=12ba', f'load_path={latest(tmp_path)}')

    def cosine(t: int, total: int, warmup: int = 2, alpha: float = 0.1, lr: float = 0.01) -> float:
        frac = (t - warmup) / (total - warmup)  # composer's CosineAnnealingWithWarmupScheduler
        return lr * (alpha + (1 - alpha) * 0.5 * (1 + math.cos(math.pi * frac)))
    line = (f'the run is extended from 6 to 12 batches (it had finished): the LR schedule now '
            f'spans 12 batches; LR at batch 6: {cosine(6, 6):.6g} under the checkpoint\'s length, '
            f'{cosine(6, 12):.6g} now')
    assert line in proc.stdout
    assert len(sample_log(tmp_path / 'samples.jsonl')) == 12


@pytest.mark.slow
def test_a_checkpoint_in_streamings_order_is_refused_in_one_line(tmp_path, data):
    """A data position written when the order was streaming's sampler (streaming's own dataset
    state, or a position of version 1-2) cannot be resumed: refused with one line, exit 2."""
    old = tmp_path / 'old'
    old.mkdir()
    cfg = plain_config(old, data, save_interval='5ba')
    train(cfg, 'callbacks.stop_at.time=5ba')
    ckpt = torch.load(latest(old), map_location='cpu', weights_only=False)
    for name, position in [('streaming', {
            'epoch': 0, 'sample_in_epoch': 5 * BATCH, 'num_canonical_nodes': 1, 'shuffle_seed': 3,
            'initial_physical_nodes': None, 'global_batch_size': BATCH}),
            ('v2', {**ckpt['state']['dataset_state']['train'], 'version': 2})]:
        ckpt['state']['dataset_state']['train'] = position
        legacy = old / f'{name}.pt'
        torch.save(ckpt, legacy)
        proc = train(cfg, f'load_path={legacy}', check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            "foundrymix train: error: the checkpoint was written by an older foundrymix, whose "
            "sample order was streaming's sampler: it cannot be resumed by this version (the order "
            "is now foundrymix's own); start the run again, or finish it with the version that "
            "wrote it")
        assert 'Traceback' not in proc.stderr

