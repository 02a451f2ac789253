"""Exact epochs on any topology, against the real loader's rows on every rank; stratified
shares realized or refused; plan --nodes/--ranks-per-node."""

from __future__ import annotations

import json
import math
from collections import Counter
from fractions import Fraction

import pytest

from foundrymix.cli import main
from foundrymix.config import ConfigError
from foundrymix.plan.exact import trim_chooses
from foundrymix.loader.mixer import StreamMixer
from mix_helpers import build_stream, build_three, identity, loader_dict, write_yaml


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp('exact')
    build_three(str(root), (120, 80, 60))
    build_stream(str(root / 'a65'), 'pretrain', 65, 0)
    return root


def dirs(root):
    return {n: str(root / n) for n in ('arxiv', 'wiki', 'dolly')}


def largest_remainder(weights, total):
    """Brute force, in exact fractions: every stream its quota's floor, then one more to each of
    the largest remainders; of equal remainders the stream listed first."""
    w = [Fraction(x) for x in weights]
    quotas = [total * x / sum(w) for x in w]
    out = [math.floor(q) for q in quotas]
    best = sorted(range(len(w)), key=lambda i: (-(quotas[i] - out[i]), i))
    for i in best[:total - sum(out)]:
        out[i] += 1
    return out


def test_rows_per_stream_are_the_weights_largest_remainder_for_every_seed(tmp_path):
    """Three streams at 1/3 and an epoch of 100, seven at 1/7 and an epoch of 10: the same rows
    per stream for every shuffle seed (streaming's seeded +1 gave 33/33/34 or 33/34/33, and five
    vectors over six seeds), the loader's own rows, equal to the largest remainder."""
    for n, size in ((3, 100), (7, 10)):
        dirs = {f's{k}': str(tmp_path / f'{n}s{k}') for k in range(n)}
        for k, d in enumerate(dirs.values()):
            build_stream(d, 'pretrain', 1000 if n == 3 else 30, k)
        want = largest_remainder([Fraction(1, n)] * n, size)
        for seed in range(6):
            m = StreamMixer.from_dict(loader_dict(dirs, {s: {'proportion': 1 / n} for s in dirs},
                                                  epoch_size=size, shuffle_seed=seed))
            plan = m.plan(size, '1ep')
            assert [s.rows_per_epoch for s in plan.streams] == want, (n, seed)
            got = Counter(tag for tag, _ in loader_rows(m, size)[0])
            assert [got[k] for k in range(n)] == want, (n, seed)
    assert largest_remainder([Fraction(1, 3)] * 3, 100) == [34, 33, 33]


def test_trim_chooses_splits_the_cut_by_share():
    assert trim_chooses((120, 200, 30), 6) == (118, 197, 29)   # 2.06, 3.43, 0.51 -> 2, 3, 1
    # with rows (120, 80, 60): from the fractional passes 0, 40, 30 first: 3.43, 2.57 -> 3, 3
    assert trim_chooses((120, 200, 30), 6, (120, 80, 60)) == (120, 197, 27)
    assert trim_chooses((120, 200, 30), 72, (120, 80, 60)) == (119, 159, 0)  # 70 + 2 of 320
    assert sum(trim_chooses((7, 1, 1), 5)) == 4 and all(c >= 0 for c in trim_chooses((7, 1, 1), 5))


def loader_rows(mixer, batch, epochs=1, world_size=1):
    """(stream tag, row) of every row each rank's loader trains, rank by rank."""
    out = []
    for rank in range(world_size):
        loader = mixer.build_dataloader(batch, epochs=epochs, world_size=world_size, rank=rank)
        out.append([identity(r) for b in loader for r in b['input_ids'].numpy()])
        loader.release()
    return out


@pytest.mark.parametrize('nodes, ranks, batch', [(1, 2, 3), (2, 3, 1), (2, 2, 2), (4, 2, 1)])
def test_exact_epoch_is_padding_free_on_the_topology(root, nodes, ranks, batch):
    """65 rows: every rank's loader together train each row of the exact epoch once."""
    mixer = StreamMixer.from_dict({'streams': {'a': {'local': str(root / 'a65')}}})
    plan = mixer.plan(batch, '1ep', world_size=nodes * ranks, nodes=nodes)
    G = batch * nodes * ranks
    assert plan.epoch_size == 65 - 65 % G and plan.left_out_per_epoch == {'a': 65 % G}
    per_rank = loader_rows(mixer, batch, world_size=nodes * ranks)
    rows = sorted(r for rank in per_rank for _, r in rank)
    assert len(rows) == len(set(rows)) == plan.epoch_size       # no padding repeat
    assert [len(r) for r in per_rank] == [plan.epoch_size // (nodes * ranks)] * (nodes * ranks)
    assert (plan.samples_per_epoch, plan.repeated_rows_per_epoch) == (plan.epoch_size, 0)
    assert [r.samples_per_epoch for r in plan.per_rank] == [len(r) for r in per_rank]


def test_absolute_weights_are_trimmed_and_iteration_equals_plan(root):
    """repeat 1 / 2.5 / 0.5 = 350 rows; a global batch of 8 -> 344, cut in proportion."""
    m = StreamMixer.from_dict(loader_dict(dirs(root), {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5},
                                                       'dolly': {'repeat': 0.5}}, shuffle_seed=17))
    plan = m.plan(8, '1ep')
    assert plan.epoch_size == 344 and plan.left_out_per_epoch == {'arxiv': 0, 'wiki': 3, 'dolly': 3}
    assert {s.name: s.rows_per_epoch for s in plan.streams} == {'arxiv': 120, 'wiki': 197, 'dolly': 27}
    got = Counter(tag for tag, _ in loader_rows(m, 8)[0])
    assert got == {0: 120, 1: 197, 2: 27}        # the loader's own rows
    assert any('exact epoch: 344 rows = 43 whole global batches of 8 (the weights ask for 350); '
               'left out per epoch: wiki 3 (of 200), dolly 3 (of 30)' in n for n in plan.notes)


def test_a_stream_the_exact_epoch_rounds_up_is_named_as_such_never_as_a_negative_left_out(root, tmp_path):
    """Proportions 0.1/0.35/0.35/0.2 of 325 rows, global batch 3: lowering epoch_size to 324
    re-apportions every share, and the largest remainder gives arxiv a row more than at 325
    (32.4 -> 33 beside 32.5 -> 32): named as taken beyond, never as a negative left out."""
    build_stream(str(tmp_path / 'd4'), 'pretrain', 65, 3)
    streams = {**dirs(root), 'd4': str(tmp_path / 'd4')}
    props = (0.1, 0.35, 0.35, 0.2)
    m = StreamMixer.from_dict(loader_dict(streams, {n: {'proportion': p} for n, p in zip(streams, props)}))
    plan = m.plan(3, '1ep')
    asked, trained = largest_remainder(props, 325), largest_remainder(props, 324)
    assert trained[0] == asked[0] + 1                          # the case: arxiv rounds up
    got = Counter(tag for tag, _ in loader_rows(m, 3)[0])      # the loader's own rows
    assert [got[k] for k in range(4)] == trained
    assert [s.rows_per_epoch for s in plan.streams] == trained
    assert plan.left_out_per_epoch == {n: max(0, a - t) for n, a, t in zip(streams, asked, trained)}
    [note] = [n for n in plan.notes if n.startswith('exact epoch')]
    left = ', '.join(f'{n} {a - t} (of {a})' for n, a, t in zip(streams, asked, trained) if a > t)
    assert note.startswith(f'exact epoch: 324 rows = 108 whole global batches of 3 (the weights ask '
                           f'for 325); left out per epoch: {left}; taken beyond the weights per '
                           f'epoch: arxiv 1 (asked {asked[0]}) --')


def test_stratified_shares_that_round_are_refused_with_the_fix(root):
    m = StreamMixer.from_dict(loader_dict({k: v for k, v in dirs(root).items() if k != 'dolly'},
                                          {'arxiv': {'proportion': 0.7}, 'wiki': {'proportion': 0.3}},
                                          batching_method='stratified'))
    with pytest.raises(ConfigError, match=r'stratified with proportions arxiv 0\.7, wiki 0\.3 cannot be '
                       r'realized in a global batch of 8: every batch would train arxiv 6 \+ wiki 2 rows '
                       r'\(arxiv 75\.0%, wiki 25\.0%\)\. Use a global batch of 10 '):
        m.plan(8, '1ep')
    with pytest.raises(ConfigError, match='cannot be realized in a global batch of 8'):
        m.build_dataloader(8, world_size=1)
    plan = m.plan(5, '1ep', world_size=2)     # 10 rows: 7 + 3, the shares asked for
    assert [s.share for s in plan.streams] == [0.7, 0.3]


def test_stratified_exact_false_shows_the_share_really_trained(root):
    m = StreamMixer.from_dict(loader_dict({k: v for k, v in dirs(root).items() if k != 'dolly'},
                                          {'arxiv': {'proportion': 0.7}, 'wiki': {'proportion': 0.3}},
                                          batching_method='stratified', exact=False))
    plan = m.plan(8, '1ep')
    assert [s.share for s in plan.streams] == [0.75, 0.25]
    assert any('stratified batching trains arxiv 6 + wiki 2 rows of every global batch of 8 '
               '(arxiv 75.0%, wiki 25.0% -- the shares shown), not the requested arxiv 70.0%, '
               'wiki 30.0%' in w for w in plan.warnings)
    loader = m.build_dataloader(8)
    for b in loader:   # every batch: what the loader trains
        assert Counter(b['stream_id'].tolist()) == {0: 6, 1: 2}
    loader.release()


def test_cli_nodes_and_ranks_per_rank_figures(root, tmp_path, capsys):
    assert main(['plan', write_yaml(tmp_path, root, '1ep'), '--nodes', '2', '--ranks-per-node', '2',
                 '--json']) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan['nodes'], plan['ranks_per_node'], plan['world_size'], plan['batch_size']) == (2, 2, 4, 2)
    assert [(r['rank'], r['node'], r['local_rank']) for r in plan['per_rank']] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    totals = Counter()
    for r in plan['per_rank']:
        totals.update(r['rows_per_stream'])
        assert r['samples_per_epoch'] == plan['samples_per_epoch'] // 4
    assert dict(totals) == {s['name']: s['trained_rows_per_epoch'] for s in plan['streams']}
    assert main(['plan', write_yaml(tmp_path, root, '1ep'), '--world-size', '4']) == 0
    out = capsys.readouterr().out
    assert 'topology 1 node(s) x 4 rank(s): each rank trains its 2 rows of every global batch of one order' in out
    assert 'rank 3 (node 0, local 3): 43 batches, 86 rows/epoch' in out
    assert main(['plan', write_yaml(tmp_path, root, '1ep'), '--nodes', '2', '--world-size', '3',
                 '--ranks-per-node', '2']) == 2
    assert '--world-size 3 differs from --nodes 2 x --ranks-per-node 2 = 4' in capsys.readouterr().err



def test_rank_counts_over_the_limit_only_on_request(root, tmp_path, capsys, monkeypatch):
    """Over the default size the per-rank lines keep their exact batches and rows and say how
    to count rows per stream; --rank-counts (the advice) counts them, equal to the default
    count below the limit."""
    from foundrymix.plan import stages
    cfg = write_yaml(tmp_path, root, '1ep')
    assert main(['plan', cfg, '--world-size', '4', '--json']) == 0
    counted = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(stages, 'RANK_COUNT_LIMIT', 100)
    assert main(['plan', cfg, '--world-size', '4', '--json']) == 0
    over = json.loads(capsys.readouterr().out)
    assert [r['rows_per_stream'] for r in over['per_rank']] == [None] * 4
    assert ([(r['batches_per_epoch'], r['samples_per_epoch']) for r in over['per_rank']]
            == [(r['batches_per_epoch'], r['samples_per_epoch']) for r in counted['per_rank']])
    assert 'not counted over 100 rows an epoch (--rank-counts counts them' in over['counted']['per_rank']
    assert main(['plan', cfg, '--world-size', '4', '--png', str(tmp_path / 'mix.png')]) == 0
    out = capsys.readouterr().out
    assert '  rank 3 (node 0, local 3): 43 batches, 86 rows/epoch\n' in out
    assert (tmp_path / 'mix.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and 'picture: ' in out
    assert main(['plan', cfg, '--world-size', '4', '--rank-counts', '--json']) == 0
    asked = json.loads(capsys.readouterr().out)
    assert asked['per_rank'] == counted['per_rank'] and asked['counted']['per_rank'] == 'counted'


def test_resume_state_is_checked(root):
    from foundrymix.loader.position import check_resume
    check_resume({'global_batch_size': 8}, 8)
    check_resume({}, 8)   # a position that does not record it
    with pytest.raises(ConfigError, match=r'global batch of 8 rows, this run has 4.*Set '
                                          r'global_train_batch_size: 8 to resume'):
        check_resume({'global_batch_size': 8}, 4)


def test_proportions_lower_epoch_size_and_every_stream_gives_up_its_share(root):
    """proportion 0.5 / 0.3 / 0.2 of epoch_size 240 = 120 (one whole pass of arxiv), 72, 48;
    a global batch of 7 -> 238 rows, split again by proportion: arxiv loses a row too (the
    largest remainder over the lowered size, as docs/mixing-and-plan.md states it)."""
    m = StreamMixer.from_dict(loader_dict(dirs(root), {'arxiv': {'proportion': 0.5}, 'wiki': {'proportion': 0.3},
                                                       'dolly': {'proportion': 0.2}},
                                          epoch_size=240, shuffle_seed=17))
    plan = m.plan(7, '1ep')
    assert plan.nominal_rows_per_epoch == {'arxiv': 120, 'wiki': 72, 'dolly': 48}
    assert plan.epoch_size == 238
    got = Counter(tag for tag, _ in loader_rows(m, 7)[0])
    assert sum(got.values()) == 238 and got[0] == 119      # the loader's own rows
    assert {s.name: s.rows_per_epoch for s in plan.streams} == dict(zip(('arxiv', 'wiki', 'dolly'),
                                                                         (got[0], got[1], got[2])))
    assert plan.left_out_per_epoch == {'arxiv': 1, 'wiki': 72 - got[1], 'dolly': 48 - got[2]}


def test_weights_are_streamings_apply_weights_but_relative_ones_whole_by_largest_remainder():
    """The plan's own weight arithmetic against streaming's ``Stream.apply_weights`` (the
    meaning a weight has in streaming) over random relative, unspecified and absolute
    weights, epoch sizes, trimmed chooses and rows up to 10^10: the same epoch size, shares and
    absolute rows; relative weights made whole rows by the largest remainder (not streaming's
    seeded +1), whatever the seed streaming is given."""
    from types import SimpleNamespace

    import numpy as np
    from streaming import Stream

    from foundrymix.plan.exact import EpochWeights, weighted
    rng = np.random.default_rng(0)
    for case in range(400):
        n = int(rng.integers(1, 13))
        rows = rng.integers(1, 10 ** int(rng.integers(1, 11)), n)
        kind = case % 4
        size, chooses = None, None
        if kind == 0:      # proportions, with or without epoch_size
            specs = [dict(proportion=float(p)) for p in rng.random(n) + 0.01]
            size = int(rng.integers(1, 10 ** 9)) if case % 8 else None
        elif kind == 1:    # no weights and an epoch_size
            specs, size = [{} for _ in range(n)], int(rng.integers(1, 10 ** 9))
        elif kind == 2:    # repeat / choose / none
            specs = [[dict(repeat=float(rng.random() * 3)), dict(choose=int(rng.integers(0, 10 ** 6))),
                      {}][int(rng.integers(0, 3))] for _ in range(n)]
        else:              # an exact epoch's trimmed chooses
            specs, chooses = [{} for _ in range(n)], tuple(int(c) for c in rng.integers(0, 10 ** 6, n))
        seed = int(rng.integers(0, 2 ** 31))
        infos = [SimpleNamespace(rows=int(r), spec=SimpleNamespace(**{'proportion': None, 'repeat': None,
                                                                      'choose': None, **s}))
                 for r, s in zip(rows, specs)]
        ours = weighted(infos, EpochWeights(size, chooses, (), ()))
        streams = [Stream(local=f'/nonexistent/{i}', **({'choose': chooses[i]} if chooses else s))
                   for i, s in enumerate(specs)]
        theirs = Stream.apply_weights(streams, rows.astype(np.int64), size, seed)
        assert ours.epoch_size == theirs, case
        with np.errstate(invalid='ignore', divide='ignore'):
            shares = np.array(ours.weights, np.float64) / np.array(ours.weights, np.float64).sum()
        assert np.array_equal(shares, np.array([s.proportion for s in streams], np.float64),
                              equal_nan=True), case
        if kind < 2:
            relative = [s['proportion'] for s in specs] if kind == 0 else rows.tolist()
            assert ours.chooses.tolist() == largest_remainder(relative, theirs), case
        else:
            assert ours.chooses.tolist() == [int(s.choose) for s in streams], case


def test_apportion_is_the_largest_remainder_of_the_exact_weights():
    """The one apportioner against the brute force above: random float, integer and huge integer
    weights, equal weights (ties to the stream listed first), never above a weight when the
    total is at most their sum."""
    import numpy as np

    from foundrymix.plan.exact import apportion
    rng = np.random.default_rng(3)
    for case in range(500):
        n = int(rng.integers(1, 9))
        weights = ([float(x) for x in rng.random(n)] if case % 3 == 0 else
                   [int(x) for x in rng.integers(0, 50, n)] if case % 3 == 1 else
                   [int(x) * 10 ** 15 + 1 for x in rng.integers(1, 10 ** 4, n)])
        if sum(weights) == 0:
            continue
        total = int(rng.integers(0, 3 * int(sum(weights)) + 2 if case % 3 == 1 else 10 ** 6))
        got = apportion(weights, total).tolist()
        assert got == largest_remainder(weights, total), (case, weights, total)
        if case % 3 == 1 and total <= sum(weights):
            assert all(g <= w for g, w in zip(got, weights))
    assert apportion([1 / 7] * 7, 10).tolist() == largest_remainder([Fraction(1, 7)] * 7, 10)
    assert apportion([2, 2, 1], 2).tolist() == [1, 1, 0] and apportion([1, 2, 2], 2).tolist() == [0, 1, 1]
