"""Per-stage global batch (``stages[i].global_train_batch_size``, batch-size warm-up) at the
data level: each stage yields batches of its own size, planned with it; the position stays
exact across a change (resume before, at and after it); a trained stage keeps its batch,
a future one may change; ``plan`` shows what the loader yields. One rank, in process; two
ranks: tests/loader/test_resume_every_batch.py (its run changes the batch twice), a real
train run: tests/train/test_stages_train.py.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import yaml

from foundrymix.config import ConfigError
from foundrymix.plan.config import LoaderConfig
from helpers import build_staged_loader
from mix_helpers import build_three

BATCH = 4  # the run's global batch (one rank): the first stage keeps it


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    return build_three(str(tmp_path_factory.mktemp('stage-batch')), (120, 80, 60))


def warmup(dirs, grow=8, full=16):
    """warm (batch 4, 10ba) -> grow (batch 8, 160sp = 20 batches, inside its first epoch of
    21 batches) -> full (batch 16, 2 epochs); every seed given, so stages may be inserted."""
    return {
        'streams': {n: {'local': d} for n, d in dirs.items()},
        'stages': [
            {'name': 'warm', 'duration': '10ba', 'shuffle_seed': 5,
             'streams': {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 0.5}}},
            {'name': 'grow', 'duration': '160sp', 'shuffle_seed': 6, 'global_train_batch_size': grow,
             'streams': {'arxiv': {'repeat': 0.25}, 'wiki': {'repeat': 1}, 'dolly': {'repeat': 1}}},
            {'name': 'full', 'duration': '2ep', 'shuffle_seed': 7, 'global_train_batch_size': full,
             'streams': {'dolly': {'repeat': 1}, 'arxiv': {'repeat': 0.1}}},
        ]}


def loader(d):
    return build_staged_loader(LoaderConfig.from_dict(d), BATCH)


def ids(staged):
    return [b['sample_id'].tolist() for b in staged]


def state_at(d, at):
    """The position after ``at`` batches, JSON round-tripped as a checkpoint stores it."""
    staged = loader(d)
    it = iter(staged)
    for _ in range(at):
        next(it)
    state = json.loads(json.dumps(staged.state_dict()))
    del it
    staged.release()
    return state


@pytest.fixture(scope='module')
def straight(dirs):
    staged = loader(warmup(dirs))
    batches = [(b['stage_id'].tolist(), [staged.stream_names[i] for i in b['stream_id'].tolist()],
                b['sample_id'].tolist()) for b in staged]
    return staged.run, batches


def test_each_stage_yields_batches_of_its_own_size_as_planned(straight):
    run, batches = straight
    # grow: 160sp = 20 batches of 8; full: its epoch is 60 dolly + 12 arxiv = 72 rows -> 4
    # whole batches of 16 (an epoch of 64: exact), 2 epochs
    assert [(s.name, s.global_batch_size, s.start_batch, s.batches, s.start_sample, s.samples)
            for s in run.stages] == [('warm', 4, 0, 10, 0, 40), ('grow', 8, 10, 20, 40, 160),
                                     ('full', 16, 30, 8, 200, 128)]
    assert [len(ids) for _, _, ids in batches] == [4] * 10 + [8] * 20 + [16] * 8
    assert (run.total_batches, run.total_samples, run.total_tokens) == (38, 328, 328 * 32)
    for stage in run.stages:
        inside = batches[stage.start_batch:stage.end_batch]
        assert all(set(st) == {stage.index} for st, _, _ in inside)
        got = Counter(n for _, names, _ in inside for n in names)
        assert dict(got) == stage.plan.duration.rows_per_stream
        assert sum(got.values()) == stage.samples
    # over the run, each stream's rows are pass-complete across the batch changes: never a row
    # k+1 times before every row of its stream k times (stage by stage sample ids -> rows)
    seen = {'arxiv': [0] * 120, 'wiki': [0] * 80, 'dolly': [0] * 60}
    for stage_ids, names, sample_ids in batches:
        streams = run.stages[stage_ids[0]].plan.streams
        offset = {s.name: sum(t.rows for t in streams[:k]) for k, s in enumerate(streams)}
        for name, i in zip(names, sample_ids):
            counts = seen[name]
            counts[i - offset[name]] += 1
            k = sum(counts) // len(counts)
            assert set(counts) <= {k, k + 1}


def test_a_stage_trains_what_a_run_with_its_batch_trains(dirs, straight):
    """Independent of the staged loader's bookkeeping: stage grow's batches are laid out as
    those of a one-stage run of grow's mixture whose own global batch is 8, and its dolly (first
    trained in grow) is the same rows; arxiv and wiki go on from warm's passes instead."""
    run, batches = straight
    alone = warmup(dirs)
    alone['stages'] = [{k: v for k, v in alone['stages'][1].items()
                        if k != 'global_train_batch_size'}]
    staged = build_staged_loader(LoaderConfig.from_dict(alone), 8)
    got = [([staged.stream_names[i] for i in b['stream_id'].tolist()], b['sample_id'].tolist())
           for b in staged]
    assert [names for names, _ in got] == [names for _, names, _ in batches[10:30]]
    dolly = [[i for n, i in zip(names, b) if n == 'dolly'] for names, b in got]
    assert dolly == [[i for n, i in zip(names, b) if n == 'dolly'] for _, names, b in batches[10:30]]
    assert [b for _, b in got] != [b for _, _, b in batches[10:30]]


@pytest.mark.parametrize('at', [9, 10, 11, 29, 30, 33])
def test_resume_before_at_and_after_a_batch_change(dirs, straight, at):
    """Batch 10 and 30 are the first of a larger batch; 9/29 the last of the smaller one."""
    _, batches = straight
    state = state_at(warmup(dirs), at)
    assert state['batch'] == at
    resumed = loader(warmup(dirs))
    resumed.load_state_dict(state)
    assert ids(resumed) == [b for _, _, b in batches[at:]]


def test_a_trained_stage_keeps_its_batch(dirs):
    state = state_at(warmup(dirs), 11)  # one batch into grow
    with pytest.raises(ConfigError) as e:
        loader(warmup(dirs, grow=4)).load_state_dict(state)
    assert str(e.value) == (
        "train_loader.stages[1].global_train_batch_size: the checkpoint trained 1 batches of stage "
        "'grow' with a global batch of 8 rows, this config gives it 4; its epochs and every batch "
        "are made of that batch, so a trained stage keeps it (stages that start at or after the "
        "checkpoint may change theirs). Set train_loader.stages[1].global_train_batch_size: 8 to "
        "resume; to change the batch from here, end the stage at the resume batch (duration: 1ba) "
        "and add a stage after it with its own global_train_batch_size")
    # a finished stage too (warm, 4 -> 8 rows; still 10 batches, so nothing else moves)
    edited = warmup(dirs)
    edited['stages'][0]['global_train_batch_size'] = 8
    with pytest.raises(ConfigError, match=r'train_loader.stages \(warm\): its data changed since the '
                                          r'checkpoint \(global batch size 4 -> 8 \(a trained '
                                          r"stage's global_train_batch_size must stay fixed\)\)"):
        loader(edited).load_state_dict(state)


def test_the_advice_works(dirs, straight):
    """End grow at the resume batch and continue with another batch: the trained past is
    unchanged, the new stage trains with its own batch."""
    state = state_at(warmup(dirs), 11)
    d = warmup(dirs)
    rest = copy.deepcopy(d['stages'][1])
    d['stages'][1]['duration'] = '1ba'
    d['stages'].insert(2, {**rest, 'name': 'grow-16', 'global_train_batch_size': 16,
                           'duration': '64sp'})
    resumed = loader(d)
    resumed.load_state_dict(state)
    assert [len(b) for b in ids(resumed)] == [16] * 4 + [16] * 8


@pytest.mark.parametrize('at, stage, batch', [(10, 1, 4), (30, 2, 8)])
def test_a_stage_starting_at_the_checkpoint_may_change_its_batch(dirs, at, stage, batch):
    """The immutable-past / editable-future rule: the stage that starts exactly at the
    checkpoint has trained nothing, so its batch (and with it its length in batches for a
    duration in sp/ep) may change; the resumed run is the edited run's straight run."""
    state = state_at(warmup(dirs), at)
    edited = warmup(dirs, **({'grow': batch} if stage == 1 else {'full': batch}))
    straight_edited = ids(loader(edited))
    resumed = loader(edited)
    resumed.load_state_dict(state)
    assert ids(resumed) == straight_edited[at:]
    assert {len(b) for b in straight_edited[at:at + 1]} == {batch}


def test_plan_shows_the_batch_samples_and_tokens_of_every_stage(dirs, straight, tmp_path, capsys):
    from foundrymix.cli import main
    from helpers import tiny_run_config
    run, batches = straight
    cfg = tiny_run_config(warmup(dirs), global_train_batch_size=BATCH, max_seq_len=32)
    cfg['model']['max_position_embeddings'] = 32
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg))
    assert main(['plan', '--json', str(path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(s['global_batch_size'], s['batches'], s['samples'], s['tokens'], s['start_sample'])
            for s in plan['stages']] == [(4, 10, 40, 1280, 0), (8, 20, 160, 5120, 40),
                                         (16, 8, 128, 4096, 200)]
    yielded = sum(len(b) for _, _, b in batches)
    assert (plan['total_batches'], plan['total_samples'], plan['total_tokens']) == \
        (len(batches), yielded, yielded * 32)
    assert main(['plan', str(path)]) == 0
    out = capsys.readouterr().out
    assert 'Stages (38 global batches of 4-16 rows x 32 tokens: 328 samples, 10,496 tokens)' \
        in ' '.join(out.split())
    assert '│ 1 grow │ 160sp │ 8 │ 20 │ 10 │ 29 │ 160 │ 5,120 │ 0.9524 │' in ' '.join(out.split())
    assert 'Composer counts the run in samples (max_duration 328sp)' in ' '.join(out.split())


def test_the_microbatch_must_divide_every_stage_batch_in_plan_and_train(dirs, tmp_path, capsys):
    """Refused up front, in the same words, by plan and by train (before anything is built)."""
    from foundrymix.cli import main
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config
    from helpers import tiny_run_config
    d = warmup(dirs, grow=6)
    cfg = tiny_run_config(d, global_train_batch_size=BATCH, max_seq_len=32,
                          device_train_microbatch_size=4, save_folder=str(tmp_path / 'ckpt'))
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg))
    message = ('device_train_microbatch_size=4 does not divide the per-rank batch (6 = '
               'train_loader.stages[1].global_train_batch_size 6 / 1 ranks)')
    assert main(['plan', str(path)]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r'^' + message.replace('(', r'\(').replace(')', r'\)').replace('[', r'\[').replace(']', r'\]') + '$'):
        build_trainer(load_config(str(path)))
    assert not (tmp_path / 'ckpt').exists()
    # two ranks: a stage batch the ranks cannot split
    assert main(['plan', '--world-size', '2', str(path), 'device_train_microbatch_size=null',
                 'train_loader.stages.2.global_train_batch_size=15']) == 2
    assert ('train_loader.stages[2].global_train_batch_size=15 is not divisible by the 2 ranks'
            in capsys.readouterr().err)


def test_composer_counts_a_run_with_batch_changes_in_samples(straight):
    """Composer's schedules run in max_duration's unit: samples when the batch changes; a
    t_warmup inside the first stage (one batch size) converts exactly, a later one in ba is
    refused with its value in samples."""
    from foundrymix.train.preflight import composer_duration, warmup_in_samples
    run, _ = straight
    assert composer_duration(run) == '328sp'
    assert warmup_in_samples('0ba', run) == '0sp'
    assert warmup_in_samples('10ba', run) == '40sp'   # the end of warm (4 rows a batch)
    assert warmup_in_samples('640tok', run) == '20sp'
    assert warmup_in_samples('0.1dur', run) == '0.1dur'
    with pytest.raises(ConfigError, match=r'^scheduler.t_warmup: 12ba ends after the first stage.*'
                                          r'Batch 12 of this run is sample 56: give t_warmup: 56sp '
                                          r'\(the LR then warms up linearly in samples\), or a '
                                          r'fraction of the run \(0.1707dur\)$'):
        warmup_in_samples('12ba', run)
