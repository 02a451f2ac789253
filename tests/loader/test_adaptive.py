"""Adaptive mixing in the run's loader (in-process, real MDS, no model).

The loss a trainer would feed is replaced by a deterministic function of the rows each
segment trained (the test's own feeder, :class:`Feeder`), so the policy moves the weights;
what is checked is the loader's side of the contract: every decision is realized at its
exact batch as whole rows per stream (counted from the rows' own tokens, not from the
loader's ids), no row of a stream repeats before its pass is complete, resume at any
batch -- right at an update too -- continues bitwise as the straight run, and a replay of
the recorded decisions trains the same sample ids.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import Counter

import numpy as np
import pytest
from adaptive_helpers import BATCH, BATCHES, EVERY, ROWS, Feeder, build, config
from mix_helpers import build_three, identity

from foundrymix.config import ConfigError


@pytest.fixture(scope='module')
def dirs(tmp_path_factory) -> dict[str, str]:
    return build_three(str(tmp_path_factory.mktemp('adaptive-streams')), ROWS)


def straight_run(dirs, cfg=None):
    """Every batch (sample ids, the rows' own identities) and the checkpointable state
    (position + feeder) before each batch."""
    loader = build(cfg or config(dirs))
    feeder = Feeder(loader)
    batches, states = [], []
    it = iter(loader)
    for _ in range(BATCHES):
        states.append((copy.deepcopy(loader.position.state_dict()), feeder.state()))
        b = next(it)
        batches.append({'ids': b['sample_id'].tolist(),
                        'rows': [identity(x) for x in b['input_ids'].numpy()]})
        feeder.batch(b)
    loader.release()
    return batches, states, loader.position.adaptive[0]


@pytest.fixture(scope='module')
def straight(dirs):
    return straight_run(dirs)


def test_weights_change_at_the_decided_batch_as_whole_rows(straight):
    batches, _, c = straight
    assert [d.batch for d in c.decisions] == [0, 3, 6, 9, 12, 15, 18]
    weights = [tuple(round(w, 6) for w in d.weights) for d in c.decisions]
    assert len(set(weights)) >= 3, weights  # the policy moved the weights more than once
    assert c.decisions[-1].weights[0] > 0.4 + 0.1  # toward arxiv, whose loss falls
    for k, d in enumerate(c.decisions):
        n = min(EVERY, BATCHES - d.batch)
        assert sum(d.rows) == n * BATCH
        # the rows trained in the segment, by the stream tag their tokens carry
        tags = Counter(tag for b in batches[d.batch:d.batch + n] for tag, _ in b['rows'])
        assert [tags.get(i, 0) for i in range(3)] == d.rows, (k, d)


def test_no_row_repeats_before_its_stream_pass_is_complete(straight):
    batches, _, c = straight
    drawn: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for b in batches:
        for tag, row in b['rows']:
            drawn[tag].append(row)
    assert len(drawn[0]) > 2 * ROWS[0]  # arxiv is read over more than two passes
    for tag, rows in drawn.items():
        n = ROWS[tag]
        for start in range(0, len(rows), n):  # every pass is a permutation of the stream
            chunk = rows[start:start + n]
            assert len(set(chunk)) == len(chunk), (tag, start)
            if len(chunk) == n:
                assert sorted(chunk) == list(range(n))


@pytest.mark.parametrize('at', [1, 3, 7, 9, 19])  # 3 and 9: right at an update
def test_resume_at_any_batch_is_bitwise_the_straight_run(dirs, straight, at):
    batches, states, c = straight
    position, fed = states[at]
    state = json.loads(json.dumps(position))   # what a checkpoint keeps: plain data
    loader = build(config(dirs))
    loader.position.load_state_dict(state)
    feeder = Feeder(loader)
    feeder.load(fed)
    got = []
    for b in loader:
        got.append(b['sample_id'].tolist())
        feeder.batch(b)
    assert got == [b['ids'] for b in batches[at:]]
    resumed = loader.position.adaptive[0]
    assert [d.to_dict() for d in resumed.decisions] == [d.to_dict() for d in c.decisions]
    assert resumed.policy.state_dict() == c.policy.state_dict()


def test_replay_of_the_recorded_decisions_trains_the_same_ids(dirs, straight, tmp_path):
    batches, _, c = straight
    path = tmp_path / 'mixture.json'
    path.write_text(json.dumps({'stages': {'main': c.report()}}), encoding='utf-8')
    loader = build(config(dirs, method='replay', **{'from': str(path)}))
    got = [b['sample_id'].tolist() for b in loader]  # no loss fed: the file decides
    assert got == [b['ids'] for b in batches]


def test_replay_refuses_decisions_of_another_run(dirs, straight, tmp_path):
    _, _, c = straight
    path = tmp_path / 'mixture.json'
    path.write_text(json.dumps({'stages': {'main': c.report()}}), encoding='utf-8')
    cfg = config(dirs, method='replay', every='4ba', **{'from': str(path)})
    with pytest.raises(ConfigError, match=r'adaptive.from: the recorded decisions do not fit'):
        build(cfg)
    with pytest.raises(ConfigError, match=r"records no adaptive stage 'main'"):
        path.write_text('{"stages": {}}', encoding='utf-8')
        build(config(dirs, method='replay', **{'from': str(path)}))


def test_a_segment_without_its_loss_is_an_error_not_a_guess(dirs):
    from foundrymix.plan.adaptive import AdaptiveError
    loader = build(config(dirs))
    it = iter(loader)
    for _ in range(EVERY):
        next(it)
    with pytest.raises(AdaptiveError, match='segment 1 .batch 3. has no decision'):
        next(it)
    loader.release()


def test_adaptive_config_errors_come_all_at_once(dirs):
    from foundrymix.plan.config import LoaderConfig
    with pytest.raises(ConfigError) as err:
        LoaderConfig.from_dict(config(dirs, method='replay', every='5', min_share=1.5))
    text = str(err.value)
    for part in ("adaptive.every: '5' has no unit; give one (e.g. 5ba)", 'adaptive.min_share: must be in [0, 1)',
                 'method: replay goes with from:'):
        assert part in text, text
    with pytest.raises(ConfigError, match=r'min_share: 0.4 x 3 streams exceeds 1'):
        build(config(dirs, min_share=0.4))


def test_an_adaptive_stage_after_a_plain_one_starts_its_segments_at_the_stage(dirs):
    """Stage a (plain, 4 batches) then stage b (adaptive, 7 batches in segments of 3): b's
    decisions start at batches 4, 7, 10 and each segment trains exactly its rows."""
    from foundrymix.loader.run_loader import StagedDataLoader
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.stages import plan_run
    streams = {n: {'local': d} for n, d in dirs.items()}
    cfg = {'streams': streams, 'stages': [
        {'name': 'a', 'duration': '4ba', 'streams': {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 1}}},
        {'name': 'b', 'duration': '7ba', 'epoch_size': 200,
         'streams': {'wiki': {'proportion': 0.5}, 'dolly': {'proportion': 0.5}},
         'adaptive': {'method': 'odm', 'every': f'{EVERY}ba', 'min_share': 0.05}}]}
    run, _ = plan_run(LoaderConfig.from_dict(cfg), BATCH)
    loader = StagedDataLoader(run)
    c = loader.position.adaptive[1]
    names = loader.stream_names  # run-wide: arxiv, wiki, dolly
    rows = []
    for b in loader:
        rows.append([names[i] for i in b['stream_id'].tolist()])
        done = loader.position.batch
        if 4 < done < 11 and (done - 4) % EVERY == 0:
            c.update(np.array([2.0, 6.0]) * 100, np.array([100.0, 100.0]))  # dolly's loss is higher
    assert [d.batch for d in c.decisions] == [4, 7, 10]
    assert {n for r in rows[:4] for n in r} == {'arxiv', 'wiki'}
    for d in c.decisions:
        n = min(EVERY, 11 - d.batch)
        got = Counter(x for r in rows[d.batch:d.batch + n] for x in r)
        assert [got.get('wiki', 0), got.get('dolly', 0)] == d.rows


def test_the_plan_states_what_an_adaptive_run_trains(dirs):
    """The plan restates an adaptive stage as its loader trains it: with ``fixed`` every
    segment's whole rows are known, and its rows per stream equal the rows the loader yields
    (counted by the rows' own stream tags, not from the plan's sampler, whose per-epoch counts
    differ); with ``ado`` only the warmup's rows are stated exactly, the rest as decided
    during the run, and no sampler warning is left."""
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.stages import plan_run
    cfg = config(dirs, method='fixed')
    run, _ = plan_run(LoaderConfig.from_dict(cfg), BATCH, f'{BATCHES}ba')
    planned = run.stages[0].plan.duration.rows_per_stream
    batches, _, _ = straight_run(dirs, cfg)
    tags = Counter(tag for b in batches for tag, _ in b['rows'])
    assert planned == {name: tags.get(i, 0) for i, name in enumerate(('arxiv', 'wiki', 'dolly'))}
    assert sum(planned.values()) == BATCHES * BATCH

    run, _ = plan_run(LoaderConfig.from_dict(config(dirs, warmup=f'{2 * EVERY}ba')), BATCH,
                      f'{BATCHES}ba')
    plan = run.stages[0].plan
    from foundrymix.loader.mixer import StreamMixer  # StreamMixer.plan states the same
    mixed = StreamMixer.from_dict(config(dirs, warmup=f'{2 * EVERY}ba')).plan(BATCH, f'{BATCHES}ba')
    assert (mixed.adaptive, mixed.counted, mixed.notes, mixed.warnings) == (True, plan.counted, plan.notes, [])
    assert plan.duration.rows_per_stream is None and run.decided_during_run == ['main']
    assert plan.warnings == []
    assert plan.counted['run'].startswith(
        f'adaptive (ado): batches 0-{2 * EVERY - 1} exact at the configured weights (')
    assert f'batches {2 * EVERY}-{BATCHES - 1} ({(BATCHES - 2 * EVERY) * BATCH:,} rows) decided during the run' \
        in plan.counted['run']


def test_a_small_stream_the_weights_repeat_is_warned_about(tmp_path, caplog):
    """A 3-row stream at a fifth of 20 batches of 8 is read 10+ times over: warned once
    (at 10x; 20x is not reached), naming the stream; the other streams are not named."""
    small = build_three(str(tmp_path / 'streams'), (40, 80, 3))
    cfg = config(small, method='fixed')
    loader = build(cfg)
    feeder = Feeder(loader)
    counts = np.zeros(3, np.int64)
    with caplog.at_level(logging.WARNING, logger='foundrymix.loader'):
        for b in loader:
            counts += np.bincount(b['stream_id'].numpy(), minlength=3)
            feeder.batch(b)
    loader.release()
    warnings = [r.getMessage() for r in caplog.records if 'times over' in r.getMessage()]
    assert counts[2] / 3 >= 10 and counts[2] / 3 < 20, counts  # the trained rows, counted here
    assert len(warnings) == 1 and warnings[0].startswith("adaptive: stream 'dolly' (3 rows) has been read ")
