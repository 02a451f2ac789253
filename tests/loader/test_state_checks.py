"""``load_state_dict`` refuses, in one line naming what is wrong, every state it cannot resume:
not a dict, a key missing or of the wrong type, a future version, a batch inconsistent with its
stage, and any load while an iterator of the loader is open. A real state, taken from a real run
at batch 7 of a two-stage run, is the starting point of each case."""

from __future__ import annotations

import pytest

import foundrymix
from foundrymix.config import ConfigError
from helpers import staged as config


@pytest.fixture(scope='module')
def state(small_streams):
    loader = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    it = iter(loader)
    for _ in range(7):
        next(it)
    it.close()
    got = loader.state_dict()
    loader.release()
    assert (got['batch'], got['batch_in_stage']) == (7, 2)
    return got


def without(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize('edit, said', [
    (lambda s: None, 'loader state: a dict is needed, got NoneType'),
    (lambda s: [s], 'loader state: a dict is needed, got list'),
    (lambda s: without(s, 'stages'), "loader state: no 'stages' (keys: version, batch,"),
    (lambda s: without(s, 'batch'), "loader state: no 'batch' (keys: version, total_batches,"),
    (lambda s: {**s, 'batch': -3, 'batch_in_stage': 0}, 'loader state: batch -3 with batch_in_stage 0: both must be >= 0'),
    (lambda s: {**s, 'batch': '5'}, "loader state: 'batch' must be an integer, got '5'"),
    (lambda s: {**s, 'version': 99}, 'loader state: written by a newer foundrymix (data position version 99; this one reads'),
    (lambda s: {**s, 'version': '4'}, "loader state: 'version' must be an integer, got '4'"),
    (lambda s: {**s, 'batch': 8}, 'loader state: batch 8 is batch 2 of a stage starting at 6, which no trained stage does'),
    (lambda s: {**s, 'stages': [{'name': 'text'}]}, 'loader state: stages[0] must hold name, start_batch, batches and fingerprint'),
])
def test_a_malformed_state_is_refused_in_one_line_naming_it(small_streams, state, edit, said):
    loader = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    with pytest.raises(ConfigError) as e:
        loader.load_state_dict(edit(state))
    assert str(e.value).startswith(said) and '\n' not in str(e.value), str(e.value)
    loader.load_state_dict(state)  # the real state still resumes, at its batch
    assert loader.state_dict()['batch'] == 7


def test_loading_into_an_open_iterator_is_refused_and_after_it_closes_resumes(small_streams, state):
    loader = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    it = iter(loader)
    first = next(it)['sample_id'].tolist()
    with pytest.raises(ConfigError, match='load_state_dict: an iterator of this loader is open'):
        loader.load_state_dict(state)
    it.close()
    loader.load_state_dict(state)
    resumed = next(iter(loader))['sample_id'].tolist()
    straight = foundrymix.build_loader(config(small_streams), rank=0, world_size=1)
    batches = [b['sample_id'].tolist() for b in straight]
    assert first == batches[0] and resumed == batches[7]
    loader.release()
