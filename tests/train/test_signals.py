"""Ctrl-C and SIGTERM during a checkpoint write, and refused starts, with real processes and signals.

A real ``python train.py`` saving every batch (a 6 MB checkpoint) gets the signal the moment the
file of batch 4 appears, i.e. while it is written: it must exit ``128 + signal`` with one line
naming the newest complete checkpoint, leave only whole checkpoints under final names, and
resume from it. A refused start must leave the folder tree as it was.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, tiny_run_config

STOP_AT = 'ba4-'  # the signal goes when a file of batch 4 appears in the folder


def write_config(path: Path, streams: dict, workers: int, **top) -> Path:
    loader = {'streams': {n: {'local': str(p)} for n, p in streams.items()}, 'shuffle': True,
              'num_workers': workers}
    cfg = tiny_run_config(loader, **{'run_name': 'sig', 'global_train_batch_size': 6, 'max_duration': '300ba',
                                     'save_interval': '1ba', 'save_folder': str(path.parent / 'ckpt'),
                                     'log_interval': '100ba',
                                     'scheduler': {'name': 'cosine_with_warmup', 't_warmup': '2ba'}, **top})
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def stop_mid_save(cfg: Path, sig: int, group: bool) -> subprocess.CompletedProcess:
    """Run ``train.py`` and send ``sig`` (to its process group, as a terminal's Ctrl-C does, with
    ``group``) as soon as batch 4's checkpoint file appears."""
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), str(cfg)], cwd=cfg.parent, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    folder, deadline = cfg.parent / 'ckpt', time.time() + 400
    while proc.poll() is None and time.time() < deadline:
        if folder.is_dir() and any(STOP_AT in name for name in os.listdir(folder)):
            (os.killpg if group else os.kill)(proc.pid, sig)
            break
        time.sleep(0.001)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def batch_of(path: Path) -> int:
    return int(path.name.split('-ba')[1].split('-')[0])


def checkpoints(folder: Path) -> list[Path]:
    return sorted(folder.glob('ep*-ba*-rank0.pt'), key=batch_of)


def assert_stopped_cleanly(proc: subprocess.CompletedProcess, folder: Path, sig: int) -> Path:
    """One line, exit 128 + sig, every file under a final name whole; returns the newest."""
    saved = checkpoints(folder)
    assert saved, proc.stderr[-3000:]
    newest = saved[-1]
    lines = proc.stderr.splitlines()
    said = (f'; newest complete checkpoint: {newest}; to resume there, run the same command with '
            f'autoresume=true (or with load_path={newest})')
    # the batch being trained when the signal came: the one after the newest checkpoint, or that
    # one itself where the signal came just after its write
    assert lines in ([f'foundrymix train: stopped by {signal.Signals(sig).name} after batch {b}{said}']
                     for b in (batch_of(newest) + 1, batch_of(newest))), proc.stderr[-3000:]
    assert proc.returncode == 128 + sig
    assert sorted(p.name for p in folder.iterdir()) == sorted([p.name for p in saved] + ['latest-rank0.pt'])
    for path in saved:  # every checkpoint under a final name loads
        assert torch.load(path, map_location='cpu', weights_only=False)['state']['timestamp']
    assert os.path.realpath(folder / 'latest-rank0.pt') == str(newest)
    return newest


@pytest.mark.slow  # two whole train.py runs
def test_ctrl_c_mid_save_says_one_line_keeps_whole_checkpoints_and_resumes(tmp_path, small_streams):
    """SIGINT to the process group (the trainer and its 2 DataLoader workers), as Ctrl-C sends it."""
    cfg = write_config(tmp_path / 'c.yaml', small_streams, workers=2)
    newest = assert_stopped_cleanly(stop_mid_save(cfg, signal.SIGINT, group=True), tmp_path / 'ckpt',
                                    signal.SIGINT)
    batch = batch_of(newest)
    resumed = subprocess.run([sys.executable, str(ROOT / 'train.py'), str(cfg), 'autoresume=true',
                              f'max_duration={batch + 2}ba'], cwd=tmp_path, capture_output=True, text=True,
                             timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f'resumed from {tmp_path / "ckpt" / "latest-rank0.pt"} at batch {batch} ' in resumed.stdout
    last = torch.load(tmp_path / 'ckpt' / 'latest-rank0.pt', map_location='cpu', weights_only=False)
    assert last['state']['timestamp']['Timestamp']['batch'] == batch + 2


@pytest.mark.slow  # a whole train.py run
def test_sigterm_mid_save_says_one_line_and_keeps_whole_checkpoints(tmp_path, small_streams):
    """SIGTERM to the trainer alone (a scheduler's pre-emption), no DataLoader workers."""
    cfg = write_config(tmp_path / 'c.yaml', small_streams, workers=0)
    assert_stopped_cleanly(stop_mid_save(cfg, signal.SIGTERM, group=False), tmp_path / 'ckpt', signal.SIGTERM)


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob('*'))


def test_a_refused_start_leaves_the_folder_tree_as_it_was(tmp_path, small_streams):
    """A load_path that is no checkpoint (refused at start, in one line) and one of another model
    (refused by Composer when it loads, after its saver made save_folder): nothing is created."""
    from foundrymix.config import ConfigError
    from foundrymix.train.builder import build_trainer, train
    from foundrymix.train.config import load_config

    (tmp_path / 'junk.pt').write_bytes(b'not a checkpoint')
    cfg = write_config(tmp_path / 'c.yaml', small_streams, workers=0, save_folder=str(tmp_path / 'new' / 'ckpt'))
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=f'^load_path: {tmp_path}/junk.pt is not a whole checkpoint '
                                        r'\(BadZipFile: File is not a zip file\)'):
        build_trainer(load_config(str(cfg), [f'load_path={tmp_path}/junk.pt']))
    assert listing(tmp_path) == before

    other = load_config(str(cfg), ['max_duration=3ba', f'save_folder={tmp_path}/other'])
    train(other)
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match='the checkpoint is of another model \\(size mismatch'):
        build_trainer(load_config(str(cfg), [f'load_path={tmp_path}/other/ep0-ba1-rank0.pt',
                                             'model.hidden_size=64']))
    assert listing(tmp_path) == before
