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


def stage(state, k, **edit):
    """``state`` with ``edit`` applied to its ``k``-th trained stage."""
    stages = [dict(s) for s in state['stages']]
    stages[k].update(edit)
    return {**state, 'stages': stages}


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
    # issue 55: what still escaped (a bare ValueError/TypeError/KeyError) or was accepted
    (lambda s: {**s, 'total_batches': 'x'}, "loader state: 'total_batches' must be an integer, got 'x'"),
    (lambda s: {**s, 'total_samples': [1]}, "loader state: 'total_samples' must be an integer, got [1]"),
    (lambda s: {**s, 'adaptive': 'x'}, "loader state: 'adaptive' must be a dict, got 'x'"),
    (lambda s: stage(s, 1, fingerprint={}), 'loader state: stages[1] must hold name, start_batch, batches and fingerprint'),
    (lambda s: stage(s, 1, batches=0), "loader state: stages[1] ('mix') starts at batch 5 with 0 batches: trained stages start where"),
    (lambda s: {**s, 'stages': s['stages'] * 2}, "loader state: stages[2] ('text') starts at batch 0 with 5 batches"),
    (lambda s: {**s, 'batch_in_stage': 7}, "loader state: batch 7 is batch 7 of the stage starting at 0, but the last trained stage, 'mix', is batches 5 to 13"),
    (lambda s: {**s, 'batch_in_stage': 0}, 'loader state: batch 7 starts a stage, but the trained stages end at batch 14'),
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
