"""The trainer's plan record (:mod:`foundrymix.plan.plan_cache`): a start over unchanged
inputs reads the recorded plan, which equals a fresh ``plan_run`` field by field; any
change to a manifest, index, shard, the config or the batch plans afresh; a record that
is not this user's alone, or that differs from a fresh plan in ``verify`` mode, is never
used silently."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

from foundrymix.plan import plan_cache
from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.plan_cache import PlanRecordMismatch, first_difference, planned_run
from foundrymix.plan.simulate import Topology
from foundrymix.plan.stages import plan_run
from mix_helpers import build_three, loader_dict

TOPOLOGY = Topology(nodes=1, ranks_per_node=2)


@pytest.fixture(scope='module')
def three(tmp_path_factory):
    return build_three(str(tmp_path_factory.mktemp('plan-cache')), (120, 80, 60))


@pytest.fixture
def dirs(three, tmp_path):
    """A private copy of the three streams (the tests change files in it)."""
    out = {}
    for name, d in three.items():
        out[name] = str(tmp_path / 'data' / name)
        shutil.copytree(d, out[name])
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / 'cache'
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(root))
    monkeypatch.setenv(plan_cache.MODE_ENV, 'on')
    return root / plan_cache.RECORD_DIR


def staged(dirs: dict[str, str], **extra) -> LoaderConfig:
    """Three stages: a fractional repeat, a finetune stream, an epoch boundary in stage 2."""
    return LoaderConfig.from_dict(loader_dict(
        dirs, {}, **{'shuffle_seed': 17, **extra}, stages=[
            {'name': 'warm', 'duration': '5ba', 'streams': {'arxiv': {'repeat': 0.5}, 'dolly': {}}},
            {'name': 'main', 'duration': '2ep', 'streams': {'arxiv': {}, 'wiki': {'repeat': 2.5}}},
            {'name': 'anneal', 'duration': '7ba', 'streams': {'dolly': {'repeat': 2}, 'wiki': {'repeat': 0.25}}},
        ]))


def records(folder) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_a_second_start_reads_the_record_and_it_equals_a_fresh_plan(dirs, cache):
    config = staged(dirs)
    first, _ = planned_run(config, 4, None, TOPOLOGY)
    (name,) = records(cache)
    fresh, fresh_catalogs = plan_run(config, 4, None, TOPOLOGY)
    # the record is what the second start returns: mark it, and see the mark come back
    path = cache / name
    with open(path, 'rb') as f:
        record = pickle.load(f)
    assert first_difference((record['run'], record['catalogs']), (fresh, fresh_catalogs)) is None
    record['run'].warnings.append('from the record')
    with open(path, 'wb') as f:
        pickle.dump(record, f)
    second, catalogs = planned_run(config, 4, None, TOPOLOGY)
    assert second.warnings[-1] == 'from the record'
    second.warnings.pop()
    assert first_difference((second, catalogs), (fresh, fresh_catalogs)) is None
    assert [s.batches for s in second.stages] == [s.batches for s in fresh.stages]
    assert second.rows_per_stream == fresh.rows_per_stream
    assert [c.tokenizer for c in catalogs] == [c.tokenizer for c in fresh_catalogs]


def tamper(folder) -> None:
    """Mark every record, so that a start that uses one shows it."""
    for name in records(folder):
        path = os.path.join(folder, name)
        with open(path, 'rb') as f:
            record = pickle.load(f)
        record['run'].warnings.append('stale')
        with open(path, 'wb') as f:
            pickle.dump(record, f)


@pytest.mark.parametrize('change', ['manifest rewritten', 'index rewritten', 'shard rewritten',
                                    'shard removed', 'stream dir swapped'])
def test_a_changed_file_plans_afresh(dirs, cache, change):
    config = staged(dirs)
    planned_run(config, 4, None, TOPOLOGY)
    tamper(cache)
    d = dirs['wiki']
    shard = sorted(n for n in os.listdir(d) if n.endswith('.mds'))[1]
    if change == 'manifest rewritten':  # same bytes: only ctime (and mtime) change
        text = open(os.path.join(d, 'foundrymix.json'), 'rb').read()
        open(os.path.join(d, 'foundrymix.json'), 'wb').write(text)
    elif change == 'index rewritten':
        index = json.load(open(os.path.join(d, 'index.json')))
        json.dump(index, open(os.path.join(d, 'index.json'), 'w'))
    elif change == 'shard rewritten':
        data = bytearray(open(os.path.join(d, shard), 'rb').read())
        open(os.path.join(d, shard), 'wb').write(bytes(data))
    elif change == 'shard removed':
        os.unlink(os.path.join(d, shard))
    else:  # another copy of the same files under the same path
        shutil.move(d, d + '.old')
        shutil.copytree(d + '.old', d)
    if change == 'shard removed':
        with pytest.raises(Exception, match=shard):  # the catalog's own refusal, not a stale plan
            planned_run(config, 4, None, TOPOLOGY)
        return
    run, _ = planned_run(config, 4, None, TOPOLOGY)
    assert 'stale' not in run.warnings


def test_a_changed_stream_is_planned_from_its_new_metadata(dirs, cache, tmp_path):
    """A stream directory replaced by a smaller stream: the plan follows the new rows."""
    config = staged(dirs)
    before, _ = planned_run(config, 4, None, TOPOLOGY)
    shutil.rmtree(dirs['dolly'])
    build_three(str(tmp_path / 'other'), (120, 80, 44))
    shutil.copytree(tmp_path / 'other' / 'dolly', dirs['dolly'])
    after, _ = planned_run(config, 4, None, TOPOLOGY)
    fresh, _ = plan_run(config, 4, None, TOPOLOGY)
    assert first_difference(after, fresh) is None
    assert after.stages[0].infos[1].rows == 44 != before.stages[0].infos[1].rows


@pytest.mark.parametrize('change', ['batch', 'topology', 'seed', 'max_duration'])
def test_other_inputs_are_other_records(dirs, cache, change):
    config = staged(dirs)
    planned_run(config, 4, None, TOPOLOGY)
    tamper(cache)
    args = {'batch': (config, 2, None, TOPOLOGY),
            'topology': (config, 4, None, Topology(nodes=2, ranks_per_node=1)),
            'seed': (staged(dirs, shuffle_seed=18), 4, None, TOPOLOGY),
            'max_duration': (config, 4, '27ba', TOPOLOGY)}[change]
    try:
        run, _ = planned_run(*args)
    except Exception as e:  # refused afresh (27ba is not the stages' sum): not a record's plan
        assert change == 'max_duration', e
        return
    assert 'stale' not in run.warnings
    assert len(records(cache)) == 2


def test_verify_mode_refuses_a_record_that_differs(dirs, cache, monkeypatch):
    config = staged(dirs)
    planned_run(config, 4, None, TOPOLOGY)
    (name,) = records(cache)
    with open(cache / name, 'rb') as f:
        record = pickle.load(f)
    stage = record['run'].stages[1]
    stage.plan.duration.rows_per_stream['wiki'] += 1
    with open(cache / name, 'wb') as f:
        pickle.dump(record, f)
    monkeypatch.setenv(plan_cache.MODE_ENV, 'verify')
    with pytest.raises(PlanRecordMismatch, match=r"stages\[1\]\.plan\.duration\.rows_per_stream\['wiki'\]"):
        planned_run(config, 4, None, TOPOLOGY)
    monkeypatch.setenv(plan_cache.MODE_ENV, 'off')
    run, _ = planned_run(config, 4, None, TOPOLOGY)
    assert run.stages[1].plan.duration.rows_per_stream['wiki'] == \
        stage.plan.duration.rows_per_stream['wiki'] - 1


def test_a_record_others_may_write_is_not_read(dirs, cache):
    config = staged(dirs)
    planned_run(config, 4, None, TOPOLOGY)
    tamper(cache)
    (name,) = records(cache)
    os.chmod(cache / name, 0o664)
    run, _ = planned_run(config, 4, None, TOPOLOGY)
    assert 'stale' not in run.warnings
    os.chmod(cache / name, 0o600)
    os.chmod(cache, 0o777)
    run, _ = planned_run(config, 4, None, TOPOLOGY)
    assert 'stale' not in run.warnings


def test_a_damaged_record_is_planned_afresh(dirs, cache):
    config = staged(dirs)
    planned_run(config, 4, None, TOPOLOGY)
    (name,) = records(cache)
    data = (cache / name).read_bytes()
    (cache / name).write_bytes(data[:len(data) // 2])
    run, _ = planned_run(config, 4, None, TOPOLOGY)
    assert first_difference(run, plan_run(config, 4, None, TOPOLOGY)[0]) is None


def test_remote_and_adaptive_runs_are_not_recorded(dirs, cache):
    remote = LoaderConfig.from_dict(loader_dict(
        dirs, {'arxiv': {'remote': 's3://bucket/arxiv'}}, shuffle_seed=17))
    assert plan_cache._has_remote(remote, 'train_loader')
    adaptive = LoaderConfig.from_dict(loader_dict(
        dirs, {}, shuffle_seed=17, adaptive={'every': '2ba'}))
    planned_run(adaptive, 4, '10ba', TOPOLOGY)
    assert records(cache) == []


def test_old_records_are_pruned(dirs, cache, monkeypatch):
    monkeypatch.setattr(plan_cache, 'KEEP_RECORDS', 3)
    config = staged(dirs)
    for seed in range(5):
        planned_run(staged(dirs, shuffle_seed=seed), 4, None, TOPOLOGY)
    assert len(records(cache)) == 3
    planned_run(config, 4, None, TOPOLOGY)
    assert len(records(cache)) == 3


def test_off_plans_afresh_and_records_nothing(dirs, cache, monkeypatch):
    monkeypatch.setenv(plan_cache.MODE_ENV, 'off')
    planned_run(staged(dirs), 4, None, TOPOLOGY)
    assert records(cache) == []
    monkeypatch.setenv(plan_cache.MODE_ENV, 'sometimes')
    with pytest.raises(Exception, match='FOUNDRYMIX_PLAN_CACHE'):
        planned_run(staged(dirs), 4, None, TOPOLOGY)


def test_first_difference_names_the_place():
    import numpy as np
    a = {'x': [1, 2, {'y': np.arange(3)}], 'z': 0.5}
    b = {'x': [1, 2, {'y': np.array([0, 1, 3])}], 'z': 0.5}
    assert first_difference(a, b) == "plan['x'][2]['y'] (array values)"
    assert first_difference(a, a) is None
    assert first_difference({'z': float('nan')}, {'z': float('nan')}) is None
    assert first_difference([1], [1.0]) == 'plan[0] (type int vs float)'


@pytest.mark.parametrize('bytes_', ['other', 'same'])
def test_a_file_changed_while_planning_is_not_recorded_with_the_old_plan(dirs, cache, monkeypatch,
                                                                        bytes_):
    """A manifest rewritten after the catalog read it but before the record's ``stat`` s:
    recording its new identity with the plan of its old content would make the next start
    read a stale plan. Other content: nothing is recorded; the same bytes: recorded."""
    real = plan_cache.plan_run
    path = os.path.join(dirs['wiki'], 'foundrymix.json')

    def plan_then_edit(*args, **kwargs):
        out = real(*args, **kwargs)
        manifest = json.load(open(path))
        if bytes_ == 'other':
            manifest['options']['text_field'] = 'body'
        json.dump(manifest, open(path, 'w'))
        return out
    monkeypatch.setattr(plan_cache, 'plan_run', plan_then_edit)
    run, catalogs = planned_run(staged(dirs), 4, None, TOPOLOGY)
    assert len(records(cache)) == (0 if bytes_ == 'other' else 1)
    monkeypatch.setattr(plan_cache, 'plan_run', real)
    again, again_catalogs = planned_run(staged(dirs), 4, None, TOPOLOGY)
    wiki = [i for i in again_catalogs[1].infos() if i.name == 'wiki'][0]
    assert wiki.manifest.options.get('text_field') == ('body' if bytes_ == 'other' else None)
