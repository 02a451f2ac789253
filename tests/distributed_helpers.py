"""The 1- and 2-rank runs of ``tests/train/test_distributed.py``, shared with the GPU, node and
stage tests: one config (a global batch of ``BATCH`` over two small streams, ``lr: 0`` so the
weights stay at their seeded init), ``python train.py`` on one rank and Composer's launcher on
``RANKS`` CPU ranks, and readers of what a run leaves (its accounting report, a checkpoint).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from helpers import ROOT, free_port, tiny_run_config

BATCH = 6          # global batch
RANKS = 2
N_BATCHES = 18     # the runs cross the epoch boundary


def write_config(run: Path, data: dict[str, str], log_interval: str = '1ba', **top) -> Path:
    loader = {'streams': {'arxiv': {'local': data['arxiv'], 'repeat': 1.5}, 'dolly': {'local': data['dolly']}},
              'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0}
    callbacks = {'sample_log': {'path': str(run / 'samples.jsonl'), 'interval': '5ba'},
                 'stream_accounting': {'out_dir': str(run / 'report'), 'log_interval': log_interval, 'plot': False}}
    cfg = tiny_run_config(loader, run_name='dist-test', global_train_batch_size=BATCH,
                          max_duration=f'{N_BATCHES}ba', save_folder=str(run / 'ckpt'), callbacks=callbacks,
                          optimizer={'lr': 0.0})  # fixed weights: see test_distributed's docstring
    cfg.update(top)
    path = run / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def run(cmd: list[str], cwd: Path) -> str:
    """Runs ``cmd``; its stdout (the launcher's: rank 0's)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)
    if proc.returncode != 0:
        ranks = ''.join(f'\n--- {p.name}\n{p.read_text()[-3000:]}' for p in sorted(cwd.glob('rank*.err')))
        raise AssertionError(f'{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n'
                             f'{proc.stderr[-5000:]}{ranks}')
    return proc.stdout


def train_1rank(config: Path, *overrides: str) -> None:
    run([sys.executable, str(ROOT / 'train.py'), str(config), *overrides], config.parent)


def train_nranks(config: Path, *overrides: str, n: int = RANKS) -> str:
    """Composer's launcher (the venv's ``composer`` script), n CPU ranks on a free port."""
    launcher = Path(sys.executable).parent / 'composer'
    cmd = [str(launcher)] if launcher.exists() else [sys.executable, '-m', 'composer.cli.launcher']
    d = config.parent
    return run(cmd + ['-n', str(n), '--master_addr', '127.0.0.1', '--master_port', str(free_port()),
               '--stdout', str(d / 'rank{rank}.out'), '--stderr', str(d / 'rank{rank}.err'),
               str(ROOT / 'train.py'), str(config), *overrides], d)


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / 'report' / 'stream_accounting.json').read_text())


def checkpoint(path: Path) -> dict:
    return torch.load(path, map_location='cpu', weights_only=False)
