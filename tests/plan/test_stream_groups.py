"""Stream groups: a ``streams`` key with a glob (``web/*``) weights every stream it matches.

Each resolved mixture is compared with the same mixture written stream by stream by hand
(numbers worked out in the test from the stream sizes), through the real catalog and plan.
"""

from __future__ import annotations

import os

import pytest

from foundrymix.config import ConfigError
from foundrymix.format.schema import Manifest
from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.stages import fingerprint_changes, plan_run

from mix_helpers import build_stream

#: name -> (kind, rows): two groups of unequal members and one stream outside any group
STREAMS = {'web/a': ('pretrain', 40), 'web/b': ('pretrain', 120), 'code/x': ('finetune', 60),
           'code/y': ('finetune', 30), 'books': ('pretrain', 50)}


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('groups')
    out = {}
    for tag, (name, (kind, rows)) in enumerate(STREAMS.items()):
        out[name] = os.path.join(root, name.replace('/', '_'))
        build_stream(out[name], kind, rows, tag)
    return out


def loader(dirs, weights, **extra):
    """``train_loader``: every stream's location, then ``weights`` (pattern entries too)."""
    streams = {n: {'local': d} for n, d in dirs.items()}
    for name, w in weights.items():
        streams.setdefault(name, {}).update(w)
    return {'streams': streams, 'shuffle_seed': 3, **extra}


def rows_per_epoch(cfg):
    return {s.name: s.rows_per_epoch for s in StreamMixer.from_dict(cfg).plan(1).streams}


def test_group_proportion_by_rows_equals_hand_written(dirs):
    grouped = loader(dirs, {'web/*': {'proportion': 0.6}, 'code/*': {'proportion': 0.3},
                            'books': {'proportion': 0.1}}, epoch_size=1000)
    # by hand: web 0.6 over 40 + 120 rows, code 0.3 over 60 + 30 rows
    hand = loader(dirs, {'web/a': {'proportion': 0.15}, 'web/b': {'proportion': 0.45},
                         'code/x': {'proportion': 0.2}, 'code/y': {'proportion': 0.1},
                         'books': {'proportion': 0.1}}, epoch_size=1000)
    got = rows_per_epoch(grouped)
    assert got == rows_per_epoch(hand) == {'web/a': 150, 'web/b': 450, 'code/x': 200,
                                           'code/y': 100, 'books': 100}


def test_group_proportion_by_tokens_equals_hand_written(dirs):
    tokens = {n: Manifest.read(d).counts.tokens for n, d in dirs.items()}
    web = tokens['web/a'] + tokens['web/b']
    code = tokens['code/x'] + tokens['code/y']
    hand = {'web/a': 0.5 * tokens['web/a'] / web, 'web/b': 0.5 * tokens['web/b'] / web,
            'code/x': 0.4 * tokens['code/x'] / code, 'code/y': 0.4 * tokens['code/y'] / code,
            'books': 0.1}
    grouped = loader(dirs, {'web/*': {'proportion': 0.5}, 'code/*': {'proportion': 0.4},
                            'books': {'proportion': 0.1}}, epoch_size=2000, weights_in='tokens')
    by_hand = loader(dirs, {n: {'proportion': p} for n, p in hand.items()}, epoch_size=2000,
                     weights_in='tokens')
    plan = StreamMixer.from_dict(grouped).plan(1)
    got = {s.name: s.rows_per_epoch for s in plan.streams}
    assert got == rows_per_epoch(by_hand)
    # finetune rows are shorter than pretrain rows: by tokens is not by rows
    assert got != rows_per_epoch(loader(dirs, {'web/*': {'proportion': 0.5}, 'code/*': {'proportion': 0.4},
                                                'books': {'proportion': 0.1}}, epoch_size=2000))
    code_share = plan.stream('code/x').token_share + plan.stream('code/y').token_share
    assert abs(code_share - 0.4) < 0.01


def test_group_choose_splits_exactly_and_repeat_applies_to_each(dirs):
    cfg = loader(dirs, {'web/*': {'repeat': 2}, 'code/*': {'choose': 50}, 'books': {'choose': 25}})
    # 50 over 60 + 30 rows: 33.3 + 16.7 -> 33 + 17 (largest remainder)
    assert rows_per_epoch(cfg) == {'web/a': 80, 'web/b': 240, 'code/x': 33, 'code/y': 17,
                                   'books': 25}


def test_plan_records_and_shows_the_yaml_groups(dirs):
    from rich.console import Console

    from foundrymix.tools.render import render_plan
    cfg = loader(dirs, {'web/*': {'proportion': 0.6}, 'code/*': {'proportion': 0.3},
                        'books': {'proportion': 0.1}}, epoch_size=1000)
    plan = StreamMixer.from_dict(cfg).plan(1)
    assert plan.to_dict()['groups'] == [
        {'pattern': 'web/*', 'members': ['web/a', 'web/b'], 'weight': 'proportion', 'value': 0.6},
        {'pattern': 'code/*', 'members': ['code/x', 'code/y'], 'weight': 'proportion', 'value': 0.3}]
    console = Console(record=True, width=200)
    render_plan(plan, console)
    text = console.export_text()
    assert 'Per group (train_loader.streams patterns)' in text
    row = next(line for line in text.splitlines() if 'web/*' in line)
    assert [c.strip() for c in row.split('│')[1:7]] == ['web/*', '2', 'proportion 0.6', '160',
                                                        '600', '3.75x']


@pytest.mark.parametrize('weights, key, says', [
    ({'nope/*': {'repeat': 1}}, 'train_loader.streams.nope/*', 'matches no stream'),
    ({'web/*': {'repeat': 1}, '*/b': {'repeat': 2}}, 'train_loader.streams.*/b',
     "stream web/b is also matched by pattern 'web/*'"),
    ({'web/*': {'proportion': 0.5}, 'web/a': {'proportion': 0.1}}, 'train_loader.streams.web/a',
     "sets proportion but is a member of pattern 'web/*'"),
    ({'web/*': {'repeat': 1, 'local': '/data/web'}}, 'train_loader.streams.web/*',
     'carries only a weight (repeat, proportion or choose), not local'),
    ({'web/*': {}}, 'train_loader.streams.web/*', 'gives no weight'),
    ({'web/*': {'proportion': 0.5}, 'books': {'repeat': 1}}, 'train_loader.streams',
     'cannot mix relative and absolute weights: proportion is set on web/* but not on '
     'books (repeat), code/x (no weight), code/y (no weight)'),
    ({'web/*': {'repeat': 1}}, 'train_loader.epoch_size', 'cannot be combined with repeat/choose (set on web/*)'),
])
def test_refusals_name_the_key(weights, key, says):
    streams = {n: f'/data/{n}' for n in STREAMS}
    cfg = loader(streams, weights)
    if key == 'train_loader.epoch_size':
        cfg['epoch_size'] = 100
    with pytest.raises(ConfigError) as e:
        LoaderConfig.from_dict(cfg)
    assert str(e.value).startswith(f'{key}: ') and says in str(e.value), str(e.value)
    assert '\n' not in str(e.value)


def test_stage_group_takes_in_matching_streams_and_fingerprints_resolved_weights(dirs):
    def staged(web):
        return LoaderConfig.from_dict({
            'streams': {n: {'local': d} for n, d in dirs.items()}, 'shuffle_seed': 3,
            'stages': [{'name': 'warm', 'duration': '20ba', 'epoch_size': 1000,
                        'streams': {'web/*': {'proportion': web}, 'code/*': {'proportion': 0.3}}},
                       {'name': 'late', 'duration': '10ba', 'streams': {'books': {'repeat': 1}}}]})
    run, _ = plan_run(staged(0.7), 1)
    warm = run.stages[0]
    hand = loader({n: d for n, d in dirs.items() if n != 'books'},
                  {'web/a': {'proportion': 0.175}, 'web/b': {'proportion': 0.525},
                   'code/x': {'proportion': 0.2}, 'code/y': {'proportion': 0.1}},
                  epoch_size=1000, shuffle_seed=3)
    assert {s.name: s.rows_per_epoch for s in warm.plan.streams} == rows_per_epoch(hand)
    assert [g.pattern for g in warm.plan.groups] == ['web/*', 'code/*']
    assert run.stages[1].stream_names == ['books']
    # editing the group's weight in a trained stage changes its members' weights
    changed, _ = plan_run(staged(0.6), 1)
    diff = fingerprint_changes(warm.fingerprint, changed.stages[0].fingerprint)
    assert [d.split(':')[0] for d in diff] == ['stream web/a', 'stream web/b'], diff
