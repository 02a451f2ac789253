"""The README's main command and the example YAMLs, on the bundled samples.

``scripts/demo.sh`` runs for real (conversion of both full samples, inspect, plan,
training) with a short ``max_duration`` so the suite stays fast; every YAML in
``yamls/`` must build a trainer (model, mixer, plan) on the demo's data.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp('demo') / 'out'
    env = {**os.environ, 'OUT': str(out)}
    proc = subprocess.run(['bash', str(ROOT / 'scripts' / 'demo.sh'), 'max_duration=6ba', 'save_interval=3ba'],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
    return out, proc


def test_demo_runs_end_to_end(demo):
    out, proc = demo
    for name, kind in (('arxiv', 'pretrain'), ('dolly', 'finetune')):
        manifest = json.loads((out / 'data' / name / 'foundrymix.json').read_text())
        assert manifest['kind'] == kind and manifest['max_seq_len'] == 256
        assert manifest['counts']['rows'] * 256 == manifest['counts']['tokens'] + manifest['counts']['pad_tokens']
    report = json.loads((out / 'report' / 'stream_accounting.json').read_text())
    assert report['batch'] == 6
    assert report['total']['samples'] == 6 * 8
    assert set(report['streams']) == {'arxiv', 'dolly'}
    assert (out / 'report' / 'stream_accounting.png').exists()
    ckpts = sorted(p.name for p in (out / 'checkpoints').iterdir())
    assert 'ep0-ba3-rank0.pt' in ckpts and 'ep0-ba6-rank0.pt' in ckpts
    assert 'per-stream accounting after 6 batches' in proc.stdout
    assert 'stream_accounting.png' in proc.stdout


@pytest.mark.parametrize('yaml_name', sorted(p.name for p in (ROOT / 'yamls').glob('*.yaml')))
def test_example_yaml_builds(demo, tmp_path, yaml_name, monkeypatch):
    """Each example config validates against real shards and builds a trainer."""
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config

    out, _ = demo
    # pretrain/finetune examples read ${variables.out}/data/<name>; mixed reads ${variables.data}.
    (tmp_path / 'data').symlink_to(out / 'data')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(ROOT / 'yamls' / yaml_name),
                      [f'variables.out={tmp_path}', f'variables.data={tmp_path / "data"}'])
    run = build_trainer(cfg)
    try:
        assert run.mixer.max_seq_len == cfg.max_seq_len
        assert run.plan.streams and all(s.rows_per_epoch > 0 for s in run.plan.streams)
    finally:
        run.trainer.close()
