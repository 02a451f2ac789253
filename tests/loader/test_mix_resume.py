"""Resumption through the loader's ``state_dict`` into a fresh loader in a new process
continues exactly: mid-epoch, at an epoch boundary, with and without workers; the sample
ids are those of a straight run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from mix_helpers import build_three, loader_dict

BATCH = 4
WEIGHTS = {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5}, 'dolly': {'repeat': 1}}
EPOCH = 380  # 120 + 200 + 60 rows, whole batches of 4

# Runs in a brand-new interpreter: a fresh loader per state, resumed, iterated to the end.
CHILD = textwrap.dedent('''
    import gc, json, sys
    from foundrymix.loader.mixer import StreamMixer
    job = json.load(sys.stdin)
    out = []
    for state in job['states']:
        loader = StreamMixer.from_dict(job['config']).build_dataloader(job['batch'], epochs=3)
        loader.load_state_dict(state)
        out.append([int(i) for b in loader for i in b['sample_id']])
        del loader
        gc.collect()
    json.dump(out, sys.stdout)
''')


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    dirs = build_three(str(tmp_path_factory.mktemp('resume')))
    return loader_dict(dirs, WEIGHTS, shuffle_seed=5)


def straight(config, epochs, **extra):
    loader = StreamMixer.from_dict({**config, **extra}).build_dataloader(BATCH, epochs=epochs)
    return [int(i) for b in loader for i in b['sample_id']]


def resume_in_new_process(config, states):
    job = json.dumps({'config': {**config, 'num_workers': 0}, 'batch': BATCH, 'states': states})
    proc = subprocess.run([sys.executable, '-c', CHILD], input=job, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_resume_mid_epoch_and_at_epoch_boundary_in_a_new_process(config):
    ref = straight(config, 3)
    assert len(ref) == 3 * EPOCH
    # the run to checkpoint reads in two workers: the same ids as without
    loader = StreamMixer.from_dict({**config, 'num_workers': 2}).build_dataloader(BATCH, epochs=3)
    seen, states = [], {}
    for k, batch in enumerate(loader):
        seen += batch['sample_id'].tolist()
        if k + 1 in (30, EPOCH // BATCH):  # mid-epoch, and exactly at the end of epoch 0
            states[k + 1] = json.loads(json.dumps(loader.state_dict()))
    assert seen == ref
    assert states[30]['batch'] == 30 and states[EPOCH // BATCH]['batch'] == EPOCH // BATCH
    out = resume_in_new_process(config, [states[30], states[EPOCH // BATCH]])
    assert out[0] == ref[30 * BATCH:]
    assert out[1] == ref[EPOCH:]  # the next epoch, not a replay of epoch 0


def test_a_resume_refuses_changed_weights_and_older_positions(config):
    loader = StreamMixer.from_dict(config).build_dataloader(BATCH, epochs=1)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    del it, loader
    changed = {**config, 'streams': {**config['streams'],
                                     'wiki': {**config['streams']['wiki'], 'repeat': 2}}}
    other = StreamMixer.from_dict(changed).build_dataloader(BATCH, epochs=1)
    with pytest.raises(ConfigError, match='wiki: repeat 2.5 -> 2'):
        other.load_state_dict(state)
    old = {k: v for k, v in state.items() if k != 'version'}
    with pytest.raises(ConfigError, match="order was streaming's sampler"):
        other.load_state_dict({**old, 'version': 2})
    with pytest.raises(ConfigError, match="order was streaming's sampler"):
        other.load_state_dict({'epoch': 1, 'sample_in_epoch': 0, 'num_canonical_nodes': 1})
