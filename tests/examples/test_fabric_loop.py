"""examples/fabric_loop.py: Lightning Fabric checkpoints the loader with the model and the
optimizer; a run SIGKILLed mid-way and resumed ends exactly as the straight run."""

from __future__ import annotations

import pytest
import torch

from example_runs import assert_same_weights, command, run, run_until_killed


@pytest.mark.slow
def test_killed_and_resumed_equals_the_straight_run(tmp_path):
    data, straight, killed = tmp_path / 'data', tmp_path / 'straight', tmp_path / 'killed'
    assert 'done: 40 steps' in run(command('fabric_loop.py', straight, data))
    want = (straight / 'samples.jsonl').read_text().splitlines()
    assert len(want) == 40

    # killed at step 25, 5 steps past the checkpoint of step 20
    run_until_killed(command('fabric_loop.py', killed, data, '--hold-at', '25'), killed / 'samples.jsonl', 25)
    assert torch.load(killed / 'checkpoint.ckpt', weights_only=True)['step'] == 20
    assert (killed / 'samples.jsonl').read_text().splitlines() == want[:25]
    assert 'resumed at step 20 (global batch 20)' in run(command('fabric_loop.py', killed, data))

    assert (killed / 'samples.jsonl').read_text().splitlines() == want
    assert_same_weights(torch.load(straight / 'final.ckpt', weights_only=True)['model'],
                        torch.load(killed / 'final.ckpt', weights_only=True)['model'])
