"""examples/plain_loop.py: a plain PyTorch loop, SIGKILLed mid-run and resumed, ends exactly as
the straight run -- the same rows of the same streams in every step and bitwise-equal weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import ROOT

EXAMPLE = ROOT / 'examples' / 'plain_loop.py'


def command(out, data, *extra) -> list[str]:
    return [sys.executable, str(EXAMPLE), '--out', str(out), '--data', str(data), *extra]


def environment() -> dict:
    return {**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1',
            'TRANSFORMERS_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def run_until_killed(cmd: list[str], log, lines: int) -> None:
    """Start ``cmd``, SIGKILL it once its sample log has ``lines`` steps (it holds there)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        while not (log.exists() and len(log.read_text().splitlines()) >= lines):
            assert proc.poll() is None, f'the run ended before step {lines}: {proc.stdout.read()}'
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def final_weights(out) -> dict:
    return torch.load(out / 'final.pt', weights_only=True)


@pytest.mark.slow
def test_killed_and_resumed_equals_the_straight_run(tmp_path):
    data, straight, killed = tmp_path / 'data', tmp_path / 'straight', tmp_path / 'killed'
    done = subprocess.run(command(straight, data), cwd=ROOT, env=environment(), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    want = (straight / 'samples.jsonl').read_text().splitlines()
    assert len(want) == 48 and 'done: 48 steps' in done.stdout

    # killed at step 27: in the second stage (it starts at 24), 7 steps past the checkpoint of step 20
    run_until_killed(command(killed, data, '--hold-at', '27'), killed / 'samples.jsonl', 27)
    assert torch.load(killed / 'checkpoint.pt', weights_only=True)['step'] == 20
    assert (killed / 'samples.jsonl').read_text().splitlines() == want[:27]
    resumed = subprocess.run(command(killed, data), cwd=ROOT, env=environment(), capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert 'resumed at step 20 (global batch 20)' in resumed.stdout

    assert (killed / 'samples.jsonl').read_text().splitlines() == want
    a, b = final_weights(straight), final_weights(killed)
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
