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
from helpers import ROOT


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
