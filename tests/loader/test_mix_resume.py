"""Resumption through ``state_dict`` into a fresh dataset in a new process continues exactly.

Covers mid-epoch and the epoch boundary, where stock streaming 0.13.0 + Composer 0.32.1
would save ``{epoch: e, sample_in_epoch: 0}`` and replay the finished epoch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from streaming import StreamingDataset

from foundrymix.loader.mixer import StreamMixer
from mix_helpers import build_three, loader_dict

BATCH = 4
WEIGHTS = {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5}, 'dolly': {'repeat': 1}}

# Runs in a brand-new interpreter: fresh dataset per state, load it, iterate two epochs.
CHILD = textwrap.dedent('''
    import gc, json, sys
    from foundrymix.loader.mixer import StreamMixer
    job = json.load(sys.stdin)
    out = []
    for state in job['states']:
        mixer = StreamMixer.from_dict(job['config'])
        ds = mixer.build_dataset(job['batch'])
        ds.load_state_dict(state)
        loader = mixer.build_dataloader(job['batch'], ds)
        out.append([[int(i) for b in loader for i in b['sample_id']] for _ in range(2)])
        del loader, ds
        gc.collect()
    json.dump(out, sys.stdout)
''')


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    dirs = build_three(str(tmp_path_factory.mktemp('resume')))
    return loader_dict(dirs, WEIGHTS, shuffle_seed=5)


def epochs_of(config, n, **extra):
    mixer = StreamMixer.from_dict({**config, **extra})
    ds = mixer.build_dataset(BATCH)
    loader = mixer.build_dataloader(BATCH, ds)
    out = [[int(i) for b in loader for i in b['sample_id']] for _ in range(n)]
    del loader, ds
    return out


def resume_in_new_process(config, states):
    job = json.dumps({'config': {**config, 'num_workers': 0}, 'batch': BATCH, 'states': states})
    proc = subprocess.run([sys.executable, '-c', CHILD], input=job, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_resume_mid_epoch_and_at_epoch_boundary_in_a_new_process(config):
    ref = epochs_of(config, 3)
    assert len(ref[0]) == 380

    # The run to checkpoint: DataLoader workers advance `next_epoch` in shared memory.
    mixer = StreamMixer.from_dict({**config, 'num_workers': 2})
    ds = mixer.build_dataset(BATCH)
    loader = mixer.build_dataloader(BATCH, ds)
    seen, mid = [], None
    for k, batch in enumerate(loader):
        seen += batch['sample_id'].tolist()
        if k + 1 == 30:  # Composer's call, mid-epoch: samples so far in this epoch
            mid = ds.state_dict(num_samples=120, from_beginning=True)
            assert loader.state_dict()['sample_in_epoch'] == 120
    assert seen == ref[0]
    assert (mid['epoch'], mid['sample_in_epoch']) == (0, 120)

    # Epoch boundary. Stock streaming names the finished epoch: a resume would replay it.
    stock = StreamingDataset.state_dict(ds, 0, True)
    assert (stock['epoch'], stock['sample_in_epoch']) == (0, 0)
    # Fix 1: the sample count reaches the epoch size (StreamingDataLoader's own count too).
    by_count = ds.state_dict(380, True)
    assert (by_count['epoch'], by_count['sample_in_epoch']) == (1, 0)
    assert (loader.state_dict()['epoch'], loader.state_dict()['sample_in_epoch']) == (1, 0)
    # Fix 2: Composer's EPOCH_END -> mark_epoch_complete, then state_dict(0, True).
    assert ds.state_dict(0, True)['epoch'] == 0
    ds.mark_epoch_complete()
    by_mark = ds.state_dict(0, True)
    assert (by_mark['epoch'], by_mark['sample_in_epoch']) == (1, 0)
    # The mark is void once the next epoch starts.
    it = iter(loader)
    first = next(it)['sample_id'].tolist()
    assert first == ref[1][:BATCH]
    assert (ds.state_dict(BATCH, True)['epoch'], ds.state_dict(BATCH, True)['sample_in_epoch']) == (1, BATCH)
    assert ds.state_dict(0, True)['epoch'] == 1
    del it, loader, ds

    out = resume_in_new_process(config, [mid, by_mark, by_count])
    assert out[0] == [ref[0][120:], ref[1]]  # exact continuation, then the next epoch
    assert out[1] == [ref[1], ref[2]]        # boundary: next epoch, not a replay of epoch 0
    assert out[2] == [ref[1], ref[2]]


def test_plain_pytorch_resume_with_loader_state_in_process(config):
    """StreamingDataLoader.state_dict mid-epoch -> fresh dataset + loader -> exact rest."""
    ref = epochs_of(config, 1)[0]
    mixer = StreamMixer.from_dict(config)
    ds = mixer.build_dataset(BATCH)
    loader = mixer.build_dataloader(BATCH, ds)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    assert (state['epoch'], state['sample_in_epoch']) == (0, 28)
    del it, loader, ds
    fresh = StreamMixer.from_dict(config)
    ds2 = fresh.build_dataset(BATCH)
    loader2 = fresh.build_dataloader(BATCH, ds2)
    loader2.load_state_dict(state)
    assert [int(i) for b in loader2 for i in b['sample_id']] == ref[28:]
    del loader2, ds2
