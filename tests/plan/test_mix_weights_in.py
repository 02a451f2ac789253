"""``weights_in: tokens | loss_tokens``: proportions as shares of tokens, met by a real loader.

The requested token shares are built so that streaming's whole-row rounding is exact
(dolly: one whole pass; arxiv: uniform rows), so the realized token counts from the
batches must equal the requested ones exactly, and the plan must state the bound.
"""

from __future__ import annotations

import collections

import pytest

from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.mixture import share_rounding
from foundrymix.format.schema import Manifest

ARXIV_ROWS = 11  # of 22: half a pass of uniform pretrain rows


def loader_cfg(small_streams, p_arxiv, p_dolly, epoch_size, weights_in):
    return {'streams': {'arxiv': {'local': str(small_streams['arxiv']), 'proportion': p_arxiv},
                        'dolly': {'local': str(small_streams['dolly']), 'proportion': p_dolly}},
            'epoch_size': epoch_size, 'shuffle': True, 'shuffle_seed': 5, 'weights_in': weights_in}


def realized_tokens(mixer):
    """Real (attention-masked) tokens per stream over one epoch of the mixer's DataLoader."""
    loader = mixer.build_dataloader(1)
    counts = collections.Counter()
    for batch in loader:
        for sid, mask in zip(batch['stream_id'].tolist(), batch['attention_mask'].sum(dim=1).tolist()):
            counts[mixer.stream_names[sid]] += mask
    loader.release()
    return dict(counts)


def test_token_shares_realized_by_the_loader(small_streams):
    dolly = Manifest.read(str(small_streams['dolly'])).counts
    L = Manifest.read(str(small_streams['arxiv'])).max_seq_len
    total = dolly.tokens + ARXIV_ROWS * L
    p_arxiv, p_dolly = ARXIV_ROWS * L / total, dolly.tokens / total
    mixer = StreamMixer.from_dict(loader_cfg(small_streams, p_arxiv, p_dolly, ARXIV_ROWS + dolly.rows,
                                             'tokens'))
    plan = mixer.plan(1)
    assert [s.rows_per_epoch for s in plan.streams] == [ARXIV_ROWS, dolly.rows]
    assert [round(s.token_share, 12) for s in plan.streams] == [round(p_arxiv, 12), round(p_dolly, 12)]
    bound = share_rounding(plan.streams, 'tokens', L)
    assert any(n.startswith('weights_in: tokens: proportions are shares of tokens') and
               f'at most {100 * bound:.2g} percentage points' in n for n in plan.notes), plan.notes
    realized = realized_tokens(mixer)
    assert realized == {'arxiv': ARXIV_ROWS * L, 'dolly': dolly.tokens}
    # the same proportions read as row shares give other rows: the option is not a no-op
    rows_plan = StreamMixer.from_dict(loader_cfg(small_streams, p_arxiv, p_dolly, ARXIV_ROWS + dolly.rows,
                                                 'rows')).plan(1)
    assert [s.rows_per_epoch for s in rows_plan.streams] != [ARXIV_ROWS, dolly.rows]


def test_loss_token_shares_in_the_plan(small_streams):
    dolly = Manifest.read(str(small_streams['dolly'])).counts
    L = Manifest.read(str(small_streams['arxiv'])).max_seq_len
    total = dolly.loss_tokens + ARXIV_ROWS * L
    p = [ARXIV_ROWS * L / total, dolly.loss_tokens / total]
    plan = StreamMixer.from_dict(loader_cfg(small_streams, *p, ARXIV_ROWS + dolly.rows,
                                            'loss_tokens')).plan(1)
    assert [s.rows_per_epoch for s in plan.streams] == [ARXIV_ROWS, dolly.rows]
    assert [round(s.loss_token_share, 12) for s in plan.streams] == [round(x, 12) for x in p]


def test_weights_in_is_part_of_a_stage_fingerprint(small_streams):
    """Changing weights_in changes the data trained: the resume rules must see it."""
    from foundrymix.plan.stages import fingerprint_changes, stage_fingerprint
    prints = {}
    for weights_in in ('rows', 'tokens'):
        mixer = StreamMixer.from_dict(loader_cfg(small_streams, 0.5, 0.5, 40, weights_in))
        prints[weights_in] = stage_fingerprint(mixer.config, mixer.infos(), 1)
    assert 'weights_in' not in prints['rows']['knobs']  # fingerprints of older checkpoints unchanged
    assert fingerprint_changes(prints['rows'], prints['tokens']) == ["weights_in 'rows' -> 'tokens'"]
    assert fingerprint_changes(prints['tokens'], prints['rows']) == ["weights_in 'tokens' -> 'rows'"]


def test_weights_in_needs_proportions(small_streams):
    cfg = {'streams': {'arxiv': {'local': str(small_streams['arxiv']), 'repeat': 1}}, 'weights_in': 'tokens'}
    with pytest.raises(ConfigError) as e:
        StreamMixer.from_dict(cfg)
    assert str(e.value) == ('train_loader.weights_in: tokens applies to proportion weights only; give '
                            'every stream a proportion (not set on arxiv) or use weights_in: rows')


def test_a_token_share_with_whole_passes_sizes_the_epoch_and_a_real_epoch_trains_it(small_streams):
    """``arxiv: {proportion: 0.7, repeat: 2}`` with ``weights_in: tokens``: one epoch trains every
    arxiv row exactly twice, and the real tokens per stream over that epoch (counted from the
    loader's batches) are 70/30 to within the whole rows the plan's bound allows."""
    cfg = loader_cfg(small_streams, 0.7, 0.3, None, 'tokens')
    del cfg['epoch_size']
    cfg['streams']['arxiv']['repeat'] = 2
    mixer = StreamMixer.from_dict(cfg)
    arxiv_rows = sum(s['samples'] for s in __import__('json').loads(
        (small_streams['arxiv'] / 'index.json').read_text())['shards'])
    plan = mixer.plan(1)
    assert plan.streams[0].rows_per_epoch == 2 * arxiv_rows
    loader = mixer.build_dataloader(1)
    seen = collections.Counter()
    tokens = collections.Counter()
    for batch in loader:
        for sid, sample, mask in zip(batch['stream_id'].tolist(), batch['sample_id'].tolist(),
                                     batch['attention_mask'].sum(dim=1).tolist()):
            tokens[mixer.stream_names[sid]] += mask
            if sid == 0:
                seen[sample] += 1
    loader.release()
    assert sorted(seen.values()) == [2] * arxiv_rows  # every row twice: two whole passes
    share = tokens['arxiv'] / (tokens['arxiv'] + tokens['dolly'])
    bound = share_rounding(plan.streams, 'tokens', Manifest.read(str(small_streams['arxiv'])).max_seq_len)
    assert abs(share - 0.7) <= bound, (share, bound)
    assert any(n.startswith("the epoch is sized by arxiv's repeat: 2 beside its proportion: 0.7") for n in plan.notes)


@pytest.mark.parametrize('streams, said', [
    ({'arxiv': {'proportion': 0.7, 'repeat': 2}, 'dolly': {'proportion': 0.3, 'repeat': 1}},
     'give repeat beside proportion on one stream only'),
    ({'arxiv': {'proportion': 0.7, 'choose': 5}, 'dolly': {'proportion': 0.3}}, 'give at most one of'),
])
def test_passes_beside_a_share_are_refused_where_they_cannot_both_hold(small_streams, streams, said):
    cfg = {'streams': {n: {'local': str(small_streams[n]), **w} for n, w in streams.items()}}
    with pytest.raises(ConfigError, match=said):
        StreamMixer.from_dict(cfg).plan(1)
