"""examples/plain_loop.py: a plain PyTorch loop, SIGKILLed mid-run and resumed, ends exactly as
the straight run -- the same rows of the same streams in every step and bitwise-equal weights."""

from __future__ import annotations

import pytest
import torch

from example_runs import assert_same_weights, command, run, run_until_killed


@pytest.mark.slow
def test_killed_and_resumed_equals_the_straight_run(tmp_path):
    data, straight, killed = tmp_path / 'data', tmp_path / 'straight', tmp_path / 'killed'
    assert 'done: 48 steps' in run(command('plain_loop.py', straight, data))
    want = (straight / 'samples.jsonl').read_text().splitlines()
    assert len(want) == 48

    # killed at step 27: in the second stage (it starts at 24), 7 steps past the checkpoint of step 20
    run_until_killed(command('plain_loop.py', killed, data, '--hold-at', '27'), killed / 'samples.jsonl', 27)
    assert torch.load(killed / 'checkpoint.pt', weights_only=True)['step'] == 20
    assert (killed / 'samples.jsonl').read_text().splitlines() == want[:27]
    assert 'resumed at step 20 (global batch 20)' in run(command('plain_loop.py', killed, data))

    assert (killed / 'samples.jsonl').read_text().splitlines() == want
    assert_same_weights(torch.load(straight / 'final.pt', weights_only=True),
                        torch.load(killed / 'final.pt', weights_only=True))
