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
        prints[weights_in] = stage_fingerprint(mixer.config, mixer.catalog.infos(), 1)
    assert 'weights_in' not in prints['rows']['knobs']  # fingerprints of older checkpoints unchanged
    assert fingerprint_changes(prints['rows'], prints['tokens']) == ["weights_in 'rows' -> 'tokens'"]
    assert fingerprint_changes(prints['tokens'], prints['rows']) == ["weights_in 'tokens' -> 'rows'"]


def test_weights_in_needs_proportions(small_streams):
    cfg = {'streams': {'arxiv': {'local': str(small_streams['arxiv']), 'repeat': 1}}, 'weights_in': 'tokens'}
    with pytest.raises(ConfigError) as e:
        StreamMixer.from_dict(cfg)
    assert str(e.value) == ('train_loader.weights_in: tokens applies to proportion weights only; give '
                            'every stream a proportion (not set on arxiv) or use weights_in: rows')
