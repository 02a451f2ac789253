"""The plan's arithmetic on streaming's partition and shuffle structure equals the replay of
streaming's own ``generate_work`` (issue 22): per-stream counts over every prefix of an epoch
(mid-epoch ends), per rank, for py1s / py1e / no shuffle, random and stratified batching,
fractional repeats, several canonical nodes, nodes and ranks.

The stand-in datasets are built from shard sizes alone (``PlanDataset``, the replay's own
input), with shards small against ``shuffle_block_size`` so py1e's shifts move rows across
spans and the prefix ends fall inside spans.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.simulate import EpochSimulator, PlanDataset, Topology


def stand_in(shard_rows, chooses, G, topology, proportions=None, **knobs) -> EpochSimulator:
    config = dataclasses.replace(LoaderConfig(), **knobs)
    total = sum(chooses)
    streams = [SimpleNamespace(choose=c, proportion=(proportions[i] if proportions else c / total))
               for i, c in enumerate(chooses)]
    ds = PlanDataset(config, streams, shard_rows, total, G // topology.world_size, topology.nodes)
    return EpochSimulator(ds, topology, config)


SHARDS = [[7, 13, 5], [11, 11, 4, 9], [3, 17], [8]]   # rows 25, 35, 20, 8 = 88


@pytest.mark.parametrize('algo,chooses,cn,topo,block,seed,extra', [
    ('py1e', (25, 35, 20, 8), 1, (1, 1), 40, 17, {}),
    ('py1e', (50, 35, 20, 15), 2, (1, 2), 30, 3, {}),  # 2x, 1x, 1x, 1.875x (fractional repeat)
    ('py1e', (12, 70, 30, 8), 4, (2, 2), 25, 9176, {'num_workers': 3}),  # under one pass
    ('py1e', (25, 35, 20, 16), 8, (2, 1), 10, 5, {}),  # shards larger than the block: no shift
    ('py1e', (40, 35, 33, 12), 3, (1, 1), 64, 1,       # short spans, canonical nodes cut spans
     {'sampling_granularity': 3, 'sampling_method': 'fixed'}),
    ('py1s', (25, 35, 20, 8), 1, (1, 2), 40, 17, {'num_workers': 2}),
    ('py1s', (50, 35, 20, 15), 4, (2, 2), 40, 23, {}),
    ('py1s', (12, 70, 30, 8), 8, (1, 4), 40, 7, {'sampling_granularity': 4}),
    (None, (25, 35, 20, 8), 2, (1, 2), 40, 17, {}),    # shuffle: false
])
def test_random_prefix_and_rank_counts_equal_the_replay(algo, chooses, cn, topo, block, seed,
                                                        extra):
    topology = Topology(*topo)
    G = 16
    total = sum(chooses)
    trim = total % np.lcm(G, cn)
    chooses = (chooses[0] - trim,) + tuple(chooses[1:])  # an exact epoch, as foundrymix makes it
    knobs = dict(shuffle=algo is not None, shuffle_algo=algo or 'py1e', shuffle_block_size=block,
                 shuffle_seed=seed, num_canonical_nodes=cn, **extra)
    sim = stand_in(SHARDS, chooses, G, topology, **knobs)
    assert sim.arithmetic, sim.replay_reason
    batches = sum(chooses) // G
    for epoch in (0, 1, 2):
        replayed = [sim.counts_and_sizes(epoch, k)[0] for k in range(1, batches + 1)]
        computed = [sim.prefix_counts(epoch, k) for k in range(1, batches + 1)]
        assert [c.tolist() for c in computed] == [r.tolist() for r in replayed]
        assert computed[-1].tolist() == list(chooses)
    ranks = sim.arith_rank_counts()
    if cn % topology.world_size == 0:
        assert [r.tolist() for r in ranks] == [c.tolist() for c, _ in sim.rank_counts(0)]
    else:
        assert ranks is None


@pytest.mark.parametrize('props,G,cn,topo,workers,algo', [
    ((0.5, 0.25, 0.125, 0.125), 8, 1, (1, 1), 0, 'py1e'),
    ((0.5, 0.25, 0.125, 0.125), 16, 2, (1, 2), 2, 'py1e'),
    ((0.25, 0.25, 0.25, 0.25), 8, 4, (2, 2), 3, 'py1s'),
    ((0.375, 0.375, 0.125, 0.125), 8, 1, (1, 4), 0, 'py1e'),
])
def test_stratified_counts_equal_the_replay(props, G, cn, topo, workers, algo):
    topology = Topology(*topo)
    chooses = (40, 30, 20, 9)   # streams run out at different batches: the least decides
    sim = stand_in(SHARDS, chooses, G, topology, proportions=props, batching_method='stratified',
                   shuffle_algo=algo, shuffle_block_size=30, num_canonical_nodes=cn,
                   num_workers=workers)
    assert sim.arithmetic
    for epoch in (0, 1):
        counts, sizes = sim.counts_and_sizes(epoch)
        assert sizes == [G] * sim.stratified_batches()
        for k in range(len(sizes) + 2):
            assert sim.prefix_counts(epoch, k).tolist() == sim.counts_and_sizes(epoch, k)[0].tolist()
    assert [r.tolist() for r in sim.arith_rank_counts()] == \
        [c.tolist() for c, _ in sim.rank_counts(0)]


def test_replay_still_used_where_arithmetic_is_not_proven():
    """Epochs that are not whole global batches (exact: false) and other shuffles keep the
    replay, and say why."""
    t = Topology(1, 2)
    assert stand_in(SHARDS, (25, 35, 20, 8), 16, t).replay_reason == \
        'the epoch is not whole global batches over the canonical nodes'
    assert stand_in(SHARDS, (25, 35, 20, 16), 16, t, shuffle_algo='py1b').replay_reason == \
        'shuffle_algo py1b (arithmetic for py1s, py1e)'
