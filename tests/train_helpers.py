"""What the training tests share: a real ``python train.py`` process, its final checkpoint and
sample log, and the bitwise weight comparison every exact-resume test ends with.

A run that fails raises with the tail of its output, so a test names the cause, not just the
exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers import ROOT, tiny_run_config


def train(config: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), str(config), *overrides],
                          capture_output=True, text=True, cwd=config.parent, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f'train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}')
    return proc


def final_state(save_folder: Path) -> dict:
    ckpt = torch.load(save_folder / 'latest-rank0.pt', map_location='cpu', weights_only=False)
    return ckpt['state']


def sample_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_same_weights(a: dict, b: dict) -> None:
    wa, wb = a['model'], b['model']
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f'weights differ at {k}'


def fit_in_process(streams: dict, d: Path, batches: int = 8, stop: str | None = None, log: str = '3ba',
                   device: str = 'gpu', **top) -> dict:
    """``batches`` batches of 4 in this process (checkpoints every 2 under ``d/ckpt``, the sample log
    ``d/s.jsonl``); returns the stream report. The CUDA tests' run."""
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    loader = {'streams': {n: {'local': str(p)} for n, p in streams.items()}, 'num_workers': 0}
    callbacks = {'stream_accounting': {'out_dir': str(d / 'report'), 'log_interval': log, 'plot': False},
                 'sample_log': {'path': str(d / 's.jsonl'), 'interval': '3ba'}}
    if stop:
        callbacks['stop_at'] = {'time': stop}
    run = build_trainer(TrainConfig.from_dict(tiny_run_config(
        loader, global_train_batch_size=4, max_duration=f'{batches}ba', device=device, save_folder=str(d / 'ckpt'),
        save_interval='2ba', callbacks=callbacks, **top)))
    try:
        run.trainer.fit()
    finally:
        run.trainer.close()
        run.claims.release()
    return json.loads((d / 'report' / 'stream_accounting.json').read_text())


def checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location='cpu', weights_only=False)['state']['model']
