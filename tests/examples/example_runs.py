"""Running an example of ``examples/`` as a user does: a subprocess, killed with a real SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers import ROOT


def command(example: str, out: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / 'examples' / example), '--out', str(out), '--data', str(data), *extra]


def environment() -> dict:
    return {**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1',
            'TRANSFORMERS_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def run(cmd: list[str]) -> str:
    """Run to the end; its stdout."""
    done = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def run_until_killed(cmd: list[str], log: Path, lines: int) -> None:
    """Start ``cmd``, SIGKILL it and every process it started (its ranks) once its sample log
    has ``lines`` steps (it holds there)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        while not (log.exists() and len(log.read_text().splitlines()) >= lines):
            assert proc.poll() is None, f'the run ended before step {lines}: {proc.stdout.read()}'
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def assert_same_weights(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
