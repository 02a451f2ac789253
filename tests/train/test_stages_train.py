"""Stages in real training runs: one ``python train.py`` (or ``composer -n 2``) per run.

A 3-stage curriculum (pretrain-heavy -> mix -> finetune-heavy; a fractional repeat, a
duration in ``tok``, one in ``ep``) on real converted shards. The straight run is the
reference; runs that stop and resume -- inside a stage, exactly at a stage boundary, at
an epoch boundary inside a stage, after SIGKILL -- must give the same per-batch sample
ids and bitwise-equal final weights.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from distributed_helpers import train_nranks
from helpers import ROOT, tiny_run_config
from train_helpers import assert_same_weights, final_state, sample_log, train

pytestmark = pytest.mark.slow  # whole training runs

BATCH = 4


@pytest.fixture(scope='module')
def data(small_streams) -> dict[str, str]:
    return {name: str(path) for name, path in small_streams.items()}


def stages_loader(data: dict[str, str]) -> dict:
    return {'streams': {'arxiv': {'local': data['arxiv']}, 'dolly': {'local': data['dolly']}},
            'shuffle_seed': 3, 'num_workers': 0,
            'stages': [
                {'name': 'pretrain', 'duration': '6ba',
                 'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.25}}},
                {'name': 'mix', 'duration': f'{4 * BATCH * 128}tok',
                 'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.5}}},
                {'name': 'finetune', 'duration': '2ep',
                 'streams': {'dolly': {'repeat': 1}, 'arxiv': {'repeat': 0.5}}}]}


def write_config(run: Path, data: dict[str, str], **top) -> Path:
    callbacks = {'sample_log': {'path': str(run / 'samples.jsonl')},
                 'stream_accounting': {'out_dir': str(run / 'report'), 'log_interval': '1ba'}}
    cfg = tiny_run_config(stages_loader(data), run_name='stages', global_train_batch_size=BATCH,
                          save_folder=str(run / 'ckpt'), callbacks=callbacks,
                          scheduler={'name': 'cosine_with_warmup', 't_warmup': '2ba', 'alpha_f': 0.1})
    cfg.pop('max_duration', None)  # the sum of the stages
    cfg.update(top)
    path = run / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def planned(config: Path, world_size: int = 1):
    from foundrymix.tools.plan import plan_from_yaml
    return plan_from_yaml(str(config), world_size=world_size)


@pytest.fixture(scope='module')
def straight(tmp_path_factory, data) -> dict:
    d = tmp_path_factory.mktemp('stages-straight')
    cfg = write_config(d, data)
    train(cfg)
    return {'dir': d, 'config': cfg, 'log': sample_log(d / 'samples.jsonl'),
            'state': final_state(d / 'ckpt'), 'run': planned(cfg),
            'report': json.loads((d / 'report' / 'stream_accounting.json').read_text())}


def per_stage(log: list[dict], run) -> list[dict[str, int]]:
    names = ['arxiv', 'dolly']
    return [dict(Counter(names[s] for b in log[st.start_batch:st.end_batch] for s in b['stream_ids']))
            for st in run.stages]


def test_three_stages_follow_the_plan_exactly(straight):
    run, log = straight['run'], straight['log']
    # 2ep of finetune: its epoch is the 41 dolly rows + 11 arxiv rows = 13 batches of 4
    assert [(s.start_batch, s.batches) for s in run.stages] == [(0, 6), (6, 4), (10, 26)]
    assert [b['batch'] for b in log] == list(range(36))
    for st in run.stages:  # the switch falls on the planned batch
        assert all(set(b['stage_ids']) == {st.index} for b in log[st.start_batch:st.end_batch])
    assert per_stage(log, run) == [s.plan.duration.rows_per_stream for s in run.stages]
    # the same batches, sample for sample, as the loader yields outside the trainer
    from foundrymix.plan.config import LoaderConfig
    from helpers import build_staged_loader
    loader = build_staged_loader(LoaderConfig.from_dict(yaml.safe_load(
        straight['config'].read_text())['train_loader']), BATCH)
    assert [b['sample_id'].tolist() for b in loader] == [b['sample_ids'] for b in log]
    report = straight['report']
    assert {k: {n: c['samples'] for n, c in v.items()} for k, v in report['stages'].items()} == \
        {s.name: s.plan.duration.rows_per_stream for s in run.stages}
    png = (straight['dir'] / 'report' / 'mixture.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n'
    assert (int.from_bytes(png[16:20], 'big'), int.from_bytes(png[20:24], 'big')) == (900, 800)  # 2 panels
    # per-stage loss: the history's per-batch sums (log_interval 1ba) between the stage's bounds
    points = {p['batch']: p for p in report['history']}
    for stage in run.stages:
        first, last = points.get(stage.start_batch), points[stage.end_batch]
        for i, name in enumerate(('arxiv', 'dolly')):
            got = report['stages'][stage.name][name]
            targets = last['loss_targets'][i] - (first['loss_targets'][i] if first else 0)
            loss_sum = last['loss_sum'][i] - (first['loss_sum'][i] if first else 0.0)
            assert got['loss_targets'] == targets > 0
            assert got['loss'] == pytest.approx(loss_sum / targets, rel=1e-9)
    st = final_state(straight['dir'] / 'ckpt')
    position = st['dataset_state']['train']
    assert (position['batch'], position['stage_name'], position['batch_in_stage']) == (36, 'finetune', 26)


@pytest.fixture(scope='module')
def stopped_at_8(tmp_path_factory, data) -> dict:
    """The run stopped at batch 8 (inside stage mix) with its checkpoint there, made once for
    the two tests that start from it: ``test_resume_is_exact[inside-stage]`` (on a copy of its
    folder) and ``test_editing_a_trained_stage_refuses_to_resume`` (its checkpoint, read only)."""
    d = tmp_path_factory.mktemp('stages-stopped-8')
    train(write_config(d, data, save_interval='8ba'), 'callbacks.stop_at.time=8ba')
    return {'dir': d, 'ckpt': os.path.realpath(d / 'ckpt' / 'latest-rank0.pt')}


@pytest.mark.parametrize('stop', [8, 6, 23], ids=['inside-stage', 'stage-boundary', 'epoch-boundary-in-stage'])
def test_resume_is_exact(tmp_path, data, straight, stop, request):
    if stop == 8:  # the module's run stopped at 8: its folder as that run left it (checkpoints,
        # latest symlink, sample log, report), copied here; the resume below then runs as for 6, 23
        shutil.copytree(request.getfixturevalue('stopped_at_8')['dir'], tmp_path, symlinks=True,
                        dirs_exist_ok=True)
    cfg = write_config(tmp_path, data, save_interval=f'{stop}ba')
    if stop != 8:
        train(cfg, f'callbacks.stop_at.time={stop}ba')
    stopped = final_state(tmp_path / 'ckpt')
    assert stopped['timestamp']['Timestamp']['batch'] == stop
    assert stopped['dataset_state']['train']['batch'] == stop
    train(cfg, f'load_path={os.path.realpath(tmp_path / "ckpt" / "latest-rank0.pt")}')
    assert sample_log(tmp_path / 'samples.jsonl') == straight['log']
    assert_same_weights(final_state(tmp_path / 'ckpt'), straight['state'])
    report = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    assert report['stages'] == straight['report']['stages']


def test_sigkill_then_autoresume_is_exact(tmp_path, data, straight):
    cfg = write_config(tmp_path, data, save_interval='3ba', autoresume=True, run_name='stages-killed')
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), str(cfg)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / 'ckpt' / 'latest-rank0.pt'

    def saved_ba9() -> bool:  # the checkpoint autoresume will find (Composer's symlink) is ba9
        return latest.is_symlink() and os.readlink(latest).endswith('ep0-ba9-rank0.pt')
    deadline = time.time() + 240
    while not saved_ba9() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert saved_ba9(), 'no checkpoint at batch 9 before the deadline'
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(sample_log(tmp_path / 'samples.jsonl')) < 36, 'the run finished before it was killed'
    train(cfg)
    assert sample_log(tmp_path / 'samples.jsonl') == straight['log']
    assert_same_weights(final_state(tmp_path / 'ckpt'), straight['state'])


def test_editing_a_trained_stage_refuses_to_resume(tmp_path, data, stopped_at_8):
    cfg = write_config(tmp_path, data, save_interval='8ba')
    ckpt = stopped_at_8['ckpt']  # the run stopped at batch 8 (8ba saves), as this config trains it
    proc = train(cfg, f'load_path={ckpt}', 'train_loader.stages.0.streams.dolly.repeat=2',
                 check=False)
    assert proc.returncode == 2
    assert ('train_loader.stages (pretrain): its data changed since the checkpoint (stream dolly: '
            'repeat 0.25 -> 2.0)') in proc.stderr


def test_two_ranks_three_stages_and_resume(tmp_path, data, straight):
    straight_dir, resumed_dir = tmp_path / 'straight', tmp_path / 'resumed'
    straight_dir.mkdir()
    resumed_dir.mkdir()
    cfg = write_config(straight_dir, data)
    train_nranks(cfg)
    log = sample_log(straight_dir / 'samples.jsonl')
    run = planned(cfg, world_size=2)
    assert per_stage(log, run) == [s.plan.duration.rows_per_stream for s in run.stages]
    for st in run.stages:
        assert all(set(b['stage_ids']) == {st.index} for b in log[st.start_batch:st.end_batch])
    cfg2 = write_config(resumed_dir, data, save_interval='8ba')
    train_nranks(cfg2, 'callbacks.stop_at.time=8ba')
    train_nranks(cfg2, f'load_path={os.path.realpath(resumed_dir / "ckpt" / "latest-rank0.pt")}')
    assert sample_log(resumed_dir / 'samples.jsonl') == log
    assert_same_weights(final_state(resumed_dir / 'ckpt'), final_state(straight_dir / 'ckpt'))
    # Elastic across a stage boundary: the 2-rank checkpoint at batch 8 (inside stage mix,
    # which ends at 10) resumed on 1 rank. Every global batch, as a set, is the 1-rank run's.
    one = tmp_path / 'one-rank'
    one.mkdir()
    (one / 'samples.jsonl').write_text(''.join(json.dumps(b) + '\n' for b in log[:8]))
    train(write_config(one, data), f'load_path={next((resumed_dir / "ckpt").glob("*-ba8-rank0.pt"))}')
    reference = [Counter(b['sample_ids']) for b in straight['log']]
    assert run.stages[1].start_batch < 8 < run.stages[1].end_batch
    assert [Counter(b['sample_ids']) for b in log] == reference
    assert [Counter(b['sample_ids']) for b in sample_log(one / 'samples.jsonl')] == reference


def write_warmup_config(run: Path, data: dict[str, str], **top) -> Path:
    """The three stages with batch-size warm-up: pretrain at the run's 4 rows, mix and
    finetune at ``global_train_batch_size: 8`` (mix: 2048 tokens = 2 batches of 8;
    finetune: 2 epochs of 6 batches of 8); t_warmup 2ba (inside pretrain) runs in samples."""
    path = write_config(run, data, **top)
    cfg = yaml.safe_load(path.read_text())
    for stage in cfg['train_loader']['stages'][1:]:
        stage['global_train_batch_size'] = 2 * BATCH
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def test_batch_size_warmup_resumes_exactly_before_at_and_after_the_change(tmp_path, data):
    """One straight run; one run stopped at batch 7 that saved every batch; resumed from
    batch 5 (before the change), 6 (the first batch of 8 rows) and 7 (after it), each into
    its own folder: the same sample ids per batch and bitwise-equal final weights."""
    import shutil
    straight_dir, stopped = tmp_path / 'straight', tmp_path / 'stopped'
    for d in (straight_dir, stopped):
        d.mkdir()
    cfg = write_warmup_config(straight_dir, data)
    train(cfg)
    run = planned(cfg)
    log = sample_log(straight_dir / 'samples.jsonl')
    assert [(s.start_batch, s.batches, s.global_batch_size) for s in run.stages] == \
        [(0, 6, 4), (6, 2, 8), (8, 12, 8)]
    assert [len(b['sample_ids']) for b in log] == [4] * 6 + [8] * 14
    assert per_stage(log, run) == [s.plan.duration.rows_per_stream for s in run.stages]
    end = final_state(straight_dir / 'ckpt')['timestamp']['Timestamp']
    assert (end['batch'], end['sample'], end['token']) == (20, run.total_samples,
                                                           run.total_tokens) == (20, 136, 136 * 128)
    train(write_warmup_config(stopped, data, save_interval='1ba'), 'callbacks.stop_at.time=7ba')
    for at in (5, 6, 7):
        resumed = tmp_path / f'resumed-{at}'
        resumed.mkdir()
        shutil.copy(stopped / 'samples.jsonl', resumed / 'samples.jsonl')
        proc = train(write_warmup_config(resumed, data),
                     f'load_path={next((stopped / "ckpt").glob(f"*-ba{at}-rank0.pt"))}')
        assert f'at batch {at} ' in proc.stdout
        assert sample_log(resumed / 'samples.jsonl') == log, at
        assert_same_weights(final_state(resumed / 'ckpt'), final_state(straight_dir / 'ckpt'))
