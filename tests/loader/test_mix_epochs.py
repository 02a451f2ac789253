"""Iterating a 3-stream mix (2 pretrain, one with a fractional repeat, + finetune) matches the plan exactly."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from foundrymix.loader.mixer import StreamMixer
from foundrymix.format.schema import IGNORE_INDEX
from mix_helpers import MAX_SEQ_LEN, build_three, finetune_layout, identity, loader_dict, pretrain_row

ROWS = {'arxiv': 120, 'wiki': 80, 'dolly': 60}
REPEATS = {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5}, 'dolly': {'repeat': 1}}


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    return build_three(str(tmp_path_factory.mktemp('mix')), tuple(ROWS.values()))


def make(dirs, weights=REPEATS, **extra):
    extra.setdefault('shuffle_seed', 17)
    return StreamMixer.from_dict(loader_dict(dirs, weights, **extra))


def run_epochs(mixer, batch_size, epochs):
    """Batches of each epoch through the mixer's DataLoader, as lists of batch dicts."""
    loader = mixer.build_dataloader(batch_size, epochs=epochs)
    batches = [{k: v.numpy() for k, v in b.items()} for b in loader]
    loader.release()
    per = len(batches) // epochs
    assert per * epochs == len(batches)
    return [batches[e * per:(e + 1) * per] for e in range(epochs)]


def ids_of(epoch):
    return [int(i) for b in epoch for i in b['sample_id']]


def per_stream(mixer, epoch):
    names = mixer.stream_names
    return dict(collections.Counter(names[int(s)] for b in epoch for s in b['stream_id']))


def test_one_epoch_counts_and_repeats_equal_the_plan(dirs):
    m = make(dirs)
    plan = m.plan(4, '1ep')
    assert plan.epoch_size == 120 + 200 + 60 and plan.batches_per_epoch == 95
    (epoch,) = run_epochs(m, 4, 1)
    counts = per_stream(m, epoch)
    assert counts == {s.name: s.trained_rows_per_epoch for s in plan.streams}
    assert counts == {'arxiv': 120, 'wiki': 200, 'dolly': 60}
    assert plan.duration.rows_per_stream == counts
    # identity from the tokens themselves: stream tag and row index
    seen = collections.Counter(identity(row) for b in epoch for row in b['input_ids'])
    for tag, name in enumerate(ROWS):
        times = [seen[(tag, r)] for r in range(ROWS[name])]
        if name == 'wiki':  # repeat 2.5: each row 2 or 3 times, the planned number of each
            wiki = plan.stream('wiki')
            assert set(times) == {2, 3}
            assert times.count(3) == wiki.rows_seen_extra == 40
            assert times.count(2) == wiki.rows - wiki.rows_seen_extra == 40
        else:  # repeat 1: every row exactly once
            assert times == [1] * ROWS[name]
    # stream_id and sample_id agree with the tokens
    for b in epoch:
        for row, sid in zip(b['input_ids'], b['stream_id']):
            assert identity(row)[0] == sid


def test_three_epochs_differ_and_match_plan(dirs):
    m = make(dirs)
    plan = m.plan(4, '3ep')
    epochs = run_epochs(m, 4, 3)
    total = collections.Counter()
    for epoch in epochs:
        counts = per_stream(m, epoch)
        assert counts == {s.name: s.rows_per_epoch for s in plan.streams}
        total.update(counts)
    assert dict(total) == plan.duration.rows_per_stream
    orders = [ids_of(e) for e in epochs]
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # the fractional repeat picks a different subset of wiki rows each epoch
    wiki3 = [sorted(identity(r)[1] for b in e for r in b['input_ids'] if identity(r)[0] == 1)
             for e in epochs]
    assert wiki3[0] != wiki3[1]
    # same seed, fresh dataset: same order; another seed: another order
    again = run_epochs(make(dirs), 4, 2)
    assert [ids_of(e) for e in again] == orders[:2]
    other = run_epochs(make(dirs, shuffle_seed=18), 4, 1)
    assert ids_of(other[0]) != orders[0]


@pytest.mark.parametrize('batching, weights, batch', [
    ('random', REPEATS, 8),  # 380 rows: the last 4 are cut by drop_last
    ('stratified', {'arxiv': {'proportion': 0.5}, 'wiki': {'proportion': 0.3},
                    'dolly': {'proportion': 0.2}}, 8),
])
def test_plan_counts_exact_when_batches_cut_rows(dirs, batching, weights, batch):
    # stratified 0.5/0.3/0.2 of 8 rounds to 4+2+2: exact refuses it, exact: false trains it
    m = make(dirs, weights, batching_method=batching, exact=batching == 'random')
    plan = m.plan(batch, '2ep')
    epochs = run_epochs(m, batch, 2)
    first = per_stream(m, epochs[0])
    assert first == {s.name: s.trained_rows_per_epoch for s in plan.streams}
    total = collections.Counter(first)
    total.update(per_stream(m, epochs[1]))
    assert dict(total) == plan.duration.rows_per_stream
    assert sum(len(e) for e in epochs) == plan.duration.total_batches
    if batching == 'stratified':  # every batch has the exact composition
        for b in epochs[0]:
            assert collections.Counter(b['stream_id'].tolist()) == {0: 4, 1: 2, 2: 2}


def test_mid_epoch_duration_matches_iteration(dirs):
    m = make(dirs)
    plan = m.plan(4, '500sp')  # 125 batches = one epoch of 95 + 30 batches
    d = plan.duration
    assert (d.total_batches, d.full_epochs, d.last_epoch, d.last_batch_in_epoch,
            d.last_sample_in_epoch, d.ends_mid_epoch) == (125, 1, 1, 30, 120, True)
    assert any('ends mid-epoch' in w for w in plan.warnings)
    epochs = run_epochs(m, 4, 2)
    run = epochs[0] + epochs[1][:30]
    assert per_stream(m, run) == d.rows_per_stream


@pytest.mark.filterwarnings('ignore:This DataLoader will create')
def test_workers_give_the_same_global_order(dirs):
    orders = {}
    for workers in (0, 2, 3):
        m = make(dirs, num_workers=workers)
        orders[workers] = [ids_of(e) for e in run_epochs(m, 4, 2)]
    assert orders[0] == orders[2] == orders[3]
    assert len(orders[0][0]) == 380


def test_mixed_batch_labels_token_by_token(dirs):
    m = make(dirs, batching_method='stratified',
             weights={'arxiv': {'proportion': 2}, 'wiki': {'proportion': 1}, 'dolly': {'proportion': 1}})
    (epoch,) = run_epochs(m, 8, 1)
    batch = epoch[0]
    assert set(batch['stream_id'].tolist()) == {0, 1, 2}
    assert all(v.dtype == np.int64 for v in batch.values())
    L = MAX_SEQ_LEN
    for i in range(8):
        tag, r = identity(batch['input_ids'][i])
        ids, labels = batch['input_ids'][i], batch['labels'][i]
        if tag in (0, 1):  # pretrain: loss on every token, two documents
            exp_ids, _, doc_lens = pretrain_row(tag, r, L)
            assert (ids == exp_ids).all()
            assert (labels == ids).all()
            assert (batch['attention_mask'][i] == 1).all()
            first = doc_lens[0]
            assert batch['position_ids'][i].tolist() == list(range(first)) + list(range(L - first))
            assert batch['sequence_id'][i].tolist() == [0] * first + [1] * (L - first)
        else:  # finetune: loss only on the two responses; prompts and padding -100
            spans, doc_lens = finetune_layout(r, L)
            n_real = sum(doc_lens)
            for t in range(L):
                in_response = any(s <= t < e for s, e in spans)
                assert labels[t] == (ids[t] if in_response else IGNORE_INDEX), (r, t)
                assert batch['attention_mask'][i][t] == (1 if t < n_real else 0)
            a = doc_lens[0]
            assert batch['position_ids'][i].tolist() == (
                list(range(a)) + list(range(doc_lens[1])) + [0] * (L - n_real))
            assert batch['sequence_id'][i].tolist() == [0] * a + [1] * doc_lens[1] + [-1] * (L - n_real)
