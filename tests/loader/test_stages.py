"""Stages at the data level: exact batches per stage, exact counts, exact resume, change rules."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest

from foundrymix.config import ConfigError
from foundrymix.plan.config import LoaderConfig
from helpers import build_staged_loader
from mix_helpers import build_three, identity

BATCH = 4


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    return build_three(str(tmp_path_factory.mktemp('stages')), (120, 80, 60))


def three_stages(dirs, **extra):
    """pretrain-heavy (fractional repeat, in ba) -> mix (in tok) -> finetune-heavy (in ep)."""
    return {
        'streams': {n: {'local': d} for n, d in dirs.items()},
        'shuffle_seed': 17,
        'stages': [
            {'name': 'pretrain', 'duration': '30ba',
             'streams': {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 0.5}}},
            {'name': 'mix', 'duration': '2560tok',
             'streams': {'arxiv': {'repeat': 0.25}, 'wiki': {'repeat': 1}, 'dolly': {'repeat': 1}}},
            {'name': 'finetune', 'duration': '2ep',
             'streams': {'dolly': {'repeat': 1}, 'arxiv': {'repeat': 0.1}}},
        ],
        **extra,
    }


def loader(d, max_duration=None):
    return build_staged_loader(LoaderConfig.from_dict(d), BATCH, max_duration)


def run_all(staged):
    """Every batch: (stage ids, stream names, sample ids, (tag, row) of each sample)."""
    out = []
    for b in staged:
        out.append((b['stage_id'].tolist(), [staged.stream_names[i] for i in b['stream_id'].tolist()],
                    b['sample_id'].tolist(), [identity(ids) for ids in b['input_ids'].numpy()]))
    return out


@pytest.fixture(scope='module')
def straight(dirs):
    staged = loader(three_stages(dirs))
    return staged.run, run_all(staged)


def test_stage_lengths_are_exact_batches(straight):
    run, _ = straight
    # 2560 tokens = 20 batches of 4 rows x 32; 2ep of the finetune mixture (72 rows) = 2 x 18
    assert [(s.name, s.start_batch, s.batches) for s in run.stages] == \
        [('pretrain', 0, 30), ('mix', 30, 20), ('finetune', 50, 36)]
    assert run.total_batches == 86 and run.stages[2].plan.batches_per_epoch == 18


def test_counts_and_boundaries_equal_the_plan(straight):
    run, batches = straight
    assert len(batches) == run.total_batches
    for stage in run.stages:
        stage_batches = batches[stage.start_batch:stage.end_batch]
        assert all(set(ids) == {stage.index} for ids, *_ in stage_batches)  # switch on the batch
        got = Counter(name for _, names, _, _ in stage_batches for name in names)
        assert dict(got) == stage.plan.duration.rows_per_stream
    tags = {'arxiv': 0, 'wiki': 1, 'dolly': 2}
    for _, names, _, idents in batches:  # stream ids name the rows' true streams
        assert [tags[n] for n in names] == [t for t, _ in idents]
    total = Counter(n for _, names, _, _ in batches for n in names)
    assert dict(total) == run.rows_per_stream


def test_epochs_inside_a_stage_reshuffle(straight):
    run, batches = straight
    ft = run.stages[2]
    epochs = [batches[ft.start_batch + e * 18:ft.start_batch + (e + 1) * 18] for e in range(2)]
    rows = [[i for _, _, _, idents in ep for i in idents] for ep in epochs]
    for ep in rows:
        assert sum(1 for t, _ in ep if t == 2) == 60  # dolly 1x: a pass's worth of its draws
        assert sum(1 for t, _ in ep if t == 0) == 12  # arxiv 0.1x of 120
    assert rows[0] != rows[1]  # each epoch reshuffled


def test_passes_go_on_across_stages(straight):
    """The whole run's sample order, brute force: arxiv in all three stages, wiki and dolly in
    two. After every row, each row of a stream was trained k or k+1 times (k: the stream's
    completed passes) and exactly as many k+1 times as it has draws past k passes: no row is
    trained k+1 times before every row of its stream k times, across the stage switches too."""
    run, batches = straight
    seen = {tag: np.zeros(n, np.int64) for tag, n in enumerate((120, 80, 60))}
    for _, _, _, idents in batches:
        for tag, row in idents:
            counts = seen[tag]
            counts[row] += 1
            drawn, n = int(counts.sum()), len(counts)
            k = drawn // n
            assert ((counts == k) | (counts == k + 1)).all() and int((counts == k + 1).sum()) == drawn - k * n
    # the case: a reused stream comes back mid-pass (a fresh pass would train rows twice first)
    before = [dict(run.stages[0].plan.duration.rows_per_stream), dict(run.stages[1].plan.duration.rows_per_stream)]
    assert before[0]['arxiv'] % 120 and (before[0]['wiki'] + before[1]['wiki']) % 80
    assert before[1]['dolly'] % 60


def test_a_position_of_the_seed_dependent_order_is_refused_in_one_line(dirs):
    state = state_at(dirs, 40)
    assert state['version'] == 4
    with pytest.raises(ConfigError) as e:
        loader(three_stages(dirs)).load_state_dict({**state, 'version': 3})
    assert '\n' not in str(e.value)
    assert str(e.value).startswith('the checkpoint was written by an older foundrymix (data position '
                                   'version 3), whose rows per stream depended on the shuffle seed')
    assert str(e.value).endswith('start the run again, or finish it with the version that wrote it')


@pytest.mark.parametrize('at', [5, 30, 41, 50, 68, 85])
def test_resume_anywhere_gives_the_same_batches(dirs, straight, at):
    """Inside a stage, at a stage boundary (30, 50), at an epoch boundary inside a stage (68)."""
    _, batches = straight
    first = loader(three_stages(dirs))
    it = iter(first)
    for _ in range(at):
        next(it)
    state = first.state_dict()
    del it
    assert state['batch'] == at
    resumed = loader(three_stages(dirs))
    resumed.load_state_dict(state)
    assert run_all(resumed) == batches[at:]


def state_at(dirs, at, d=None):
    staged = loader(d or three_stages(dirs))
    it = iter(staged)
    for _ in range(at):
        next(it)
    return staged.state_dict()


def test_editing_a_trained_stage_is_refused(dirs):
    state = state_at(dirs, 40)
    changed = three_stages(dirs)
    changed['stages'][0]['streams']['wiki']['repeat'] = 2.0
    with pytest.raises(ConfigError) as e:
        loader(changed).load_state_dict(state)
    assert str(e.value).startswith('train_loader.stages (pretrain): its data changed since the '
                                   'checkpoint (stream wiki: repeat 0.5 -> 2.0)')
    current = three_stages(dirs)
    current['stages'][1]['streams']['dolly'] = {'repeat': 3}
    with pytest.raises(ConfigError, match=r'stages \(mix\): its data changed .*stream dolly: '
                                          r'repeat 1.0 -> 3.0.*duration: 10ba\) and add a new stage'):
        loader(current).load_state_dict(state)
    shorter = three_stages(dirs)
    shorter['stages'][0]['duration'] = '20ba'
    with pytest.raises(ConfigError, match=r'finished with 30 batches, now 20'):
        loader(shorter).load_state_dict(state)


def test_later_stages_may_change_and_stages_may_be_appended(dirs, straight):
    _, batches = straight
    state = state_at(dirs, 40)
    d = three_stages(dirs)
    d['stages'][2]['streams']['arxiv']['repeat'] = 0.5  # not trained yet: editable
    d['stages'].append({'name': 'extra', 'duration': '3ba', 'streams': {'wiki': {'repeat': 1}}})
    staged = loader(d)
    staged.load_state_dict(state)
    got = run_all(staged)
    assert got[:10] == batches[40:50]  # the rest of the current stage is unchanged
    # finetune now 60 + 60 rows per epoch: 2ep = 2 x 30 batches, then 'extra'
    assert staged.run.total_batches == 50 + 60 + 3 and len(got) == 113 - 40
    assert all(ids == [3] * BATCH for ids, *_ in got[-3:])


def test_end_the_current_stage_now_and_switch_the_mixture(dirs, straight):
    """The documented recipe: the current stage ends at the resume batch, a new stage follows."""
    _, batches = straight
    state = state_at(dirs, 41)
    d = three_stages(dirs)
    d['stages'][1]['duration'] = '11ba'  # the 11 batches of 'mix' already trained
    d['stages'].insert(2, {'name': 'mix2', 'duration': '5ba',
                           'streams': {'dolly': {'repeat': 1}, 'wiki': {'repeat': 1}}})
    staged = loader(d)
    staged.load_state_dict(state)
    got = run_all(staged)
    assert [g[0] for g in got[:5]] == [[2] * BATCH] * 5  # mix2 from exactly batch 41
    assert {n for g in got[:5] for n in g[1]} <= {'dolly', 'wiki'}
    assert len(got) == 5 + 36


@pytest.mark.parametrize('change, message', [
    (lambda d: d['stages'][0].update(duration='30sp'),
     r"stages\[0\].duration: 30sp is not a whole number of global batches of 4 samples: 7.5 "
     r"batches; use 28sp or 32sp"),
    (lambda d: d['stages'][1].update(duration='100tok'),
     r"stages\[1\].duration: 100tok is not a whole number of global batches of 128 tokens"),
    (lambda d: d['stages'][0].update(duration='0ba'), r"stages\[0\].duration: must be positive"),
    (lambda d: d['stages'][0].update(streams={}), r"stages\[0\].streams: a stage needs at least one stream"),
    (lambda d: d['stages'][0].update(shufle=3), r"stages\[0\]: unknown key 'shufle'"),
    (lambda d: d['stages'][0].pop('duration'), r"stages\[0\]: missing required key 'duration'"),
    (lambda d: d['stages'][2]['streams'].update(arxiv={'choose': 1}, dolly={'choose': 2}),
     r"stages\[2\].duration: the stage's epoch \(3 rows\) holds no full global batch of 4 rows"),
    (lambda d: d['streams']['arxiv'].update(repeat=2),
     r"train_loader.streams: with stages, train_loader.streams only says where streams are"),
])
def test_refusals(dirs, change, message):
    d = copy.deepcopy(three_stages(dirs))
    change(d)
    with pytest.raises(ConfigError, match=message):
        loader(d)


def test_max_duration_must_equal_the_sum(dirs):
    assert loader(three_stages(dirs), '86ba').run.total_batches == 86
    assert loader(three_stages(dirs), f'{86 * 4 * 32}tok').run.total_batches == 86
    with pytest.raises(ConfigError, match=r'max_duration: 90ba differs from the sum of the stages, '
                                          r'86ba \(86 batches\)'):
        loader(three_stages(dirs), '90ba')
    with pytest.raises(ConfigError, match=r'max_duration: 2ep is ambiguous with stages'):
        loader(three_stages(dirs), '2ep')


def adaptive_between(dirs):
    """a (plain) leaves wiki mid-pass -> b (adaptive, its rows decided from a fed loss) -> c
    (plain) reuses wiki, and arxiv from a."""
    return {'streams': {n: {'local': d} for n, d in dirs.items()}, 'stages': [
        {'name': 'a', 'duration': '15ba', 'streams': {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 1}}},
        {'name': 'b', 'duration': '30ba', 'epoch_size': 200,
         'streams': {'wiki': {'proportion': 0.5}, 'dolly': {'proportion': 0.5}},
         'adaptive': {'method': 'odm', 'every': '5ba', 'min_share': 0.05}},
        {'name': 'c', 'duration': '20ba', 'streams': {'wiki': {'repeat': 1}, 'arxiv': {'repeat': 0.5}}}]}


def fed_run(staged, states=None):
    """Every batch's (tag, row)s, stage b's loss fed at its segment boundaries (wiki higher),
    and the position before each batch in ``states``."""
    c = staged.position.adaptive[1]
    out, states = [], [] if states is None else states
    states.append(copy.deepcopy(staged.state_dict()))
    for b in staged:
        out.append([identity(ids) for ids in b['input_ids'].numpy()])
        done = staged.position.batch
        if 15 < done < 45 and (done - 15) % 5 == 0:
            c.update(np.array([6.0, 2.0]) * 100, np.array([100.0, 100.0]))
        states.append(copy.deepcopy(staged.state_dict()))
    return out


def test_passes_go_on_through_an_adaptive_stage(dirs):
    """A stream's pass goes on into an adaptive stage and out of it, though the adaptive
    stage's rows are decided during the run: over the run no wiki row is trained k+1 times
    before every wiki row k times (brute force over the rows' own tags); a resume in the stage
    after it (its start from the checkpoint's decisions) trains the same rows."""
    staged = loader(adaptive_between(dirs))
    assert staged.run.stages[0].plan.duration.rows_per_stream['wiki'] % 80  # left mid-pass
    assert staged.run.decided_during_run == ['b'] and staged.run.stages[2].after_adaptive == ((0, 1, 0),)
    states = []
    batches = fed_run(staged, states)
    wiki = [row for b in batches for tag, row in b if tag == 1]
    through_b = sum(tag == 1 for b in batches[:45] for tag, _ in b)
    assert through_b % 80 and len(wiki) > through_b  # c takes wiki mid-pass (a fresh pass: rows 3x)
    for tag, n in ((1, 80), (0, 120)):
        rows = [row for b in batches for t, row in b if t == tag]
        seen = np.zeros(n, np.int64)
        for t, row in enumerate(rows):
            seen[row] += 1
            k = (t + 1) // n
            assert ((seen == k) | (seen == k + 1)).all(), (tag, t)
    for at in (45, 52):
        resumed = loader(adaptive_between(dirs))
        resumed.load_state_dict(states[at])
        assert fed_run(resumed) == batches[at:]
    # a checkpoint written before passes went on after an adaptive stage (its fingerprint lacks
    # the knob) would train other rows in stage c: refused, naming the change
    old = copy.deepcopy(states[52])
    del old['stages'][2]['fingerprint']['knobs']['passes_after_adaptive']
    with pytest.raises(ConfigError, match=r"stages \(c\): the checkpoint is from a foundrymix that started a fresh pass"):
        loader(adaptive_between(dirs)).load_state_dict(old)
    from rich.console import Console

    from foundrymix.tools.render import render_run_plan
    console = Console(record=True, width=400)
    render_run_plan(staged.run, console)
    assert ('note: arxiv, wiki come back in a later stage and go on with their passes (as their first '
            'stage shuffles them), after an adaptive stage too') in console.export_text()
