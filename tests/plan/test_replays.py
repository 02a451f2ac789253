"""How often a plan replays streaming's ``generate_work`` (each replay is a full shuffle and
partition of the epoch: 1.1 s over 1,000 streams, issue 22), and that what it skips is what
the replay would have said."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import streaming.base.batching as batching

from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.mixture import Topology, epoch_order
from mix_helpers import build_three, loader_dict


@pytest.fixture(scope='module')
def mixer(tmp_path_factory):
    root = tmp_path_factory.mktemp('replays')
    build_three(str(root), (120, 80, 60))
    dirs = {n: str(root / n) for n in ('arxiv', 'wiki', 'dolly')}
    return StreamMixer.from_dict(loader_dict(dirs, {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5},
                                                    'dolly': {'repeat': 0.5}}, shuffle_seed=17))


@pytest.fixture
def replays(monkeypatch):
    calls = []
    real = batching.generate_work

    def counted(*args, **kwargs):
        calls.append(args[3])  # the epoch
        return real(*args, **kwargs)
    monkeypatch.setattr(batching, 'generate_work', counted)
    return calls


def stream_counts(mixer, batches) -> dict[str, int]:
    """Rows per stream of ``batches`` (sample ids index the streams' rows end to end)."""
    offsets = np.cumsum([0] + [s.rows for s in mixer.plan(8).streams])
    got = Counter(int(np.searchsorted(offsets, i, side='right')) - 1 for b in batches for i in b)
    return {n: got[k] for k, n in enumerate(mixer.stream_names)}


def test_one_rank_whole_epochs_need_no_replay(mixer, replays):
    """One rank over an exact epoch (whole batches): the per-rank counts are the epoch's;
    the original replayed the epoch for them."""
    plan = mixer.plan(8, '2ep')
    assert replays == []
    (rank,) = plan.per_rank
    assert rank.rows_per_stream == stream_counts(mixer, epoch_order(mixer.config, mixer.catalog.infos(), 8,
                                                                    Topology()))
    assert (rank.batches_per_epoch, rank.samples_per_epoch) == (plan.batches_per_epoch, plan.epoch_size)


def test_mid_epoch_end_replays_once(mixer, replays):
    """Ending inside epoch 0 on two ranks: one replay serves the per-rank counts and the rows
    of the first batches (the original ran two)."""
    plan = mixer.plan(4, '3ba', world_size=2)
    assert replays == [0]
    batches = epoch_order(mixer.config, mixer.catalog.infos(), 4, Topology(1, 2))
    assert plan.duration.rows_per_stream == stream_counts(mixer, batches[:3])


def test_mid_epoch_end_after_whole_epochs_needs_no_replay(mixer, replays):
    """A run that ends inside its third epoch: the partial epoch's rows per stream come from
    arithmetic on streaming's py1e shuffle (issue 22), equal to streaming's own order; the
    original replayed epoch 2."""
    plan = mixer.plan(8, '100ba')
    assert replays == []
    assert plan.counted == {'epoch': 'arithmetic', 'per_rank': 'arithmetic',
                            'run': "arithmetic (on streaming's py1e shuffle)"}
    bpe = plan.batches_per_epoch
    full, rem = divmod(100, bpe)
    assert full == 2 and rem > 0
    infos = mixer.catalog.infos()
    batches = [b for e in range(full) for b in epoch_order(mixer.config, infos, 8, Topology(), e)]
    batches += epoch_order(mixer.config, infos, 8, Topology(), full)[:rem]
    assert plan.duration.rows_per_stream == stream_counts(mixer, batches)
