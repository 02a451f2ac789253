"""The sample order (foundrymix/plan/order.py) against brute-force recomputation: exact counts,
pass-complete repetition, O(1) seek equal to sequential enumeration, shard locality."""

from __future__ import annotations

import numpy as np
import pytest

from foundrymix.plan import order as O


@pytest.fixture
def small_leaf(monkeypatch):
    """Leaves of 64 positions, so small blocks span many leaves and halvings."""
    monkeypatch.setattr(O, 'LEAF', 64)
    O._leaf.cache_clear()
    O._pattern.cache_clear()
    yield
    O._leaf.cache_clear()
    O._pattern.cache_clear()


def enumerate_stage(order: O.StageOrder, batches: int) -> tuple[np.ndarray, np.ndarray]:
    out = [order.batch(b) for b in range(batches)]
    return np.concatenate([s for s, _ in out]), np.concatenate([r for _, r in out])


def test_each_pass_is_a_permutation_and_windows_keep_shards_together():
    shards = [100] * 7 + [37, 5, 0, 250]
    d = O.StreamDraws(shards, key=(3, 1, 4), window_rows=220)
    N = sum(shards)
    starts = np.cumsum([0] + shards)
    shard_of = np.searchsorted(starts, np.arange(N), side='right') - 1
    passes = []
    for p in range(4):
        rows = d.rows_of(np.arange(p * N, (p + 1) * N))
        assert sorted(rows.tolist()) == list(range(N))       # every row exactly once a pass
        passes.append(rows)
        s = shard_of[rows]
        for shard in set(s.tolist()):                        # a shard is read within one window
            at = np.flatnonzero(s == shard)
            assert at.max() - at.min() < 220 + 2 * 250
    assert not all((passes[0] == p).all() for p in passes[1:])  # a fresh permutation per pass
    # seek: any draw, asked alone from a fresh object, is the same row
    fresh = O.StreamDraws(shards, key=(3, 1, 4), window_rows=220)
    for t in [0, 1, N - 1, N, 2 * N + 17, 4 * N - 1]:
        assert fresh.rows_of(np.array([t]))[0] == passes[t // N][t % N]


def test_block_counts_are_exact_and_draws_in_order(small_leaf):
    counts = np.array([300, 71, 5, 1000, 0, 1], np.int64)
    block = O.Block(counts, np.array([7, 0, 0, 3, 0, 9], np.int64), (9, 9))
    s, t = block.draws(0, block.size)
    assert np.bincount(s, minlength=6).tolist() == counts.tolist()
    for i in range(6):  # each stream's positions get its draws in increasing order, from its cursor
        assert t[s == i].tolist() == list(range(block.start[i], block.start[i] + counts[i]))
    for m in range(0, block.size + 1, 7):
        assert block.prefix_counts(m).tolist() == np.bincount(s[:m], minlength=6).tolist()
    pieces = [block.draws(a, min(a + 37, block.size)) for a in range(0, block.size, 37)]
    assert (np.concatenate([p[0] for p in pieces]) == s).all()
    assert (np.concatenate([p[1] for p in pieces]) == t).all()
    # streams are mixed at every scale: each leaf within 2 rows per halving of its share
    levels = int(np.ceil(np.log2(block.leaves()))) + 1
    for k in range(block.leaves() - 1):
        _, leaf = block.leaf(k)
        assert (np.abs(leaf - counts * 64 / block.size) <= levels).all()


@pytest.mark.parametrize('repeat', [2.5, 0.4, 3.0])
def test_pass_complete_repetition_over_epochs_and_ranks(small_leaf, repeat):
    """repeat over 3 epochs, 2 ranks: after every position, each stream's rows are trained k or
    k+1 times (never k+1 before all k); no row twice within one pass."""
    shard_rows = [[40, 40, 23], [17, 30], [9]]
    names = ['a', 'b', 'c']
    rows = [sum(r) for r in shard_rows]
    G, W = 8, 2
    per_epoch = np.array([int(repeat * n) for n in rows], np.int64)
    epoch = int(per_epoch.sum()) // G * G
    per_epoch[0] -= int(per_epoch.sum()) - epoch   # whole batches (as the plan trims)
    draws = O.stream_draws(shard_rows, names, seed=17, stage='main', window_rows=50)
    order = O.StageOrder(draws, per_epoch, G, key=(17, O.name_key('main')))
    batches = 3 * epoch // G
    streams, got = enumerate_stage(order, batches)
    assert np.bincount(streams, minlength=3).tolist() == (3 * per_epoch).tolist()
    seen = [np.zeros(n, np.int64) for n in rows]
    drawn = np.zeros(3, np.int64)
    for s, r in zip(streams.tolist(), got.tolist()):
        seen[s][r] += 1
        drawn[s] += 1
        k = drawn[s] // rows[s]
        assert seen[s].max() - seen[s].min() <= 1
        assert ((seen[s] == k) | (seen[s] == k + 1)).all()
        assert (seen[s] == k + 1).sum() == drawn[s] - k * rows[s]
    # ranks slice the same global batches: rank q's rows are columns [qB, (q+1)B)
    B = G // W
    for b in range(batches):
        s, r = order.batch(b)
        for q in range(W):
            assert (s[q * B:(q + 1) * B] == streams[b * G + q * B:b * G + (q + 1) * B]).all()
            assert (r[q * B:(q + 1) * B] == got[b * G + q * B:b * G + (q + 1) * B]).all()


def test_seek_equals_sequential_and_counts_any_prefix(small_leaf):
    draws = O.stream_draws([[13] * 5, [7] * 3, [101]], ['x', 'y', 'z'], seed=5, stage='s1')
    counts = np.array([50, 30, 88], np.int64)    # 168 = 21 batches of 8
    order = O.StageOrder(draws, counts, 8, key=(5, 1))
    streams, rows = enumerate_stage(order, 60)
    again = O.StageOrder(O.stream_draws([[13] * 5, [7] * 3, [101]], ['x', 'y', 'z'], seed=5,
                                        stage='s1'), counts, 8, key=(5, 1))
    for b in [59, 0, 33, 21, 20, 41]:
        s, r = again.batch(b)
        assert (s == streams[b * 8:(b + 1) * 8]).all() and (r == rows[b * 8:(b + 1) * 8]).all()
    for n in range(61):
        assert order.trained(n).tolist() == np.bincount(streams[:n * 8], minlength=3).tolist()
    other = O.StageOrder(O.stream_draws([[13] * 5, [7] * 3, [101]], ['x', 'y', 'z'], seed=6,
                                        stage='s1'), counts, 8, key=(6, 1))
    assert not (enumerate_stage(other, 60)[1] == rows).all()   # the seed matters


def test_stream_seeds_follow_names_not_positions():
    a = O.stream_draws([[10, 10], [5]], ['web', 'code'], seed=1, stage='main')
    b = O.stream_draws([[5], [10, 10]], ['code', 'web'], seed=1, stage='main')
    assert (a[0].rows_of(np.arange(60)) == b[1].rows_of(np.arange(60))).all()


def test_billion_rows_prefix_counts_exact_without_enumeration():
    counts = np.array([4 * 10**8, 3 * 10**8, 2 * 10**8, 10**8 + 7] + [1] * 6, np.int64)
    block = O.Block(counts, np.zeros(len(counts), np.int64), (1,))
    for m in [0, 123_456_789, block.size // 2, block.size - 1, block.size]:
        c = block.prefix_counts(m)
        assert int(c.sum()) == m and (c <= counts).all() and (c >= 0).all()
        # the prefix up to m is the leaf's prefix plus every earlier leaf: recount one leaf
        k, into = divmod(m, O.LEAF)
        if into:
            streams, _, before = block.pattern(k)
            assert (c == before + np.bincount(streams[:into], minlength=len(counts))).all()
    # halves: the first half holds half of every stream, within one row per level
    half = block.prefix_counts(block.leaves() // 2 * O.LEAF)
    assert (np.abs(half - counts * (block.leaves() // 2 * O.LEAF) / block.size) <= 40).all()


@pytest.mark.parametrize('counts, G, W, batches', [
    ([300, 170, 33, 0, 1], 24, 4, 50),      # blocks of 21 batches; G does not divide a leaf
    ([40, 24], 16, 2, 9),                   # 4 batches a block; G divides a leaf
    ([5, 2, 1], 8, 8, 30),                  # a block per batch (stratified); B = 1
    ([1000, 1], 40, 5, 26),                 # one leaf of 1,001 split unevenly, ends mid-block
])
def test_rank_counts_equal_the_enumerated_columns(small_leaf, counts, G, W, batches):
    """Each rank's rows per stream: rank q's columns [qB, (q+1)B) of every global batch of the
    enumerated order, counted here position by position."""
    names = [f's{i}' for i in range(len(counts))]
    draws = O.stream_draws([[max(c, 1)] for c in counts], names, seed=3, stage='main')
    order = O.StageOrder(draws, np.array(counts, np.int64), G, key=(3, 9))
    streams, _ = enumerate_stage(order, batches)
    ranks = (np.arange(len(streams)) % G) // (G // W)
    want = np.zeros((W, len(counts)), np.int64)
    np.add.at(want, (ranks, streams), 1)
    got = O.rank_counts(order, batches, W)
    assert got.tolist() == want.tolist()
    assert got.sum() == batches * G and (got.sum(axis=1) == batches * G // W).all()


def test_leaf_counts_walk_equals_each_leaf_descent(small_leaf):
    counts = np.array([977, 13, 0, 4001, 64], np.int64)
    block = O.Block(counts, np.zeros(5, np.int64), (7,))
    walked = list(block.leaf_counts())
    assert [k for k, _ in walked] == list(range(block.leaves()))
    assert all((c == block.leaf(k)[1]).all() for k, c in walked)


def test_a_later_stage_goes_on_with_a_streams_draws(small_leaf):
    """Stage 2 reuses stage 1's stream 'web' from where stage 1 left it (its draws, from the
    rows stage 1 trained): web's rows over both stages are its draws 0, 1, 2, ... in order,
    interleaved by position, so the two stages are pass-complete together; the start changes
    no count, and a batch asked alone (resume) is the one enumerated."""
    first = O.stream_draws([[40, 40, 23], [17]], ['web', 'code'], seed=3, stage='one', window_rows=50)
    one = O.StageOrder(first, np.array([90, 30], np.int64), 8, key=(3, 1))
    second = O.stream_draws([[9], [40, 40, 23]], ['chat', 'web'], seed=8, stage='two', window_rows=50)
    plain = O.StageOrder(second, np.array([20, 52], np.int64), 8, key=(8, 2))
    b1, b2 = 25, 40
    cursor = int(one.trained(b1)[0])
    assert cursor % 103                                     # stage 1 leaves web mid-pass
    two = O.StageOrder([second[0], first[0]], plain.counts, 8, plain.key, start=[0, cursor])
    s1, r1 = enumerate_stage(one, b1)
    s2, r2 = enumerate_stage(two, b2)
    assert [two.trained(b).tolist() for b in range(b2 + 1)] == [plain.trained(b).tolist() for b in range(b2 + 1)]
    web_rows = np.concatenate([r1[s1 == 0], r2[s2 == 1]])
    fresh = O.StreamDraws([40, 40, 23], first[0].key, window_rows=50)
    assert (web_rows == fresh.rows_of(np.arange(len(web_rows)))).all()
    seen = np.zeros(103, np.int64)
    for t, r in enumerate(web_rows.tolist()):               # brute force: never k+1 before all k
        seen[r] += 1
        k = (t + 1) // 103
        assert ((seen == k) | (seen == k + 1)).all() and (seen == k + 1).sum() == t + 1 - k * 103
    for b in [0, 17, b2 - 1]:
        s, r = O.StageOrder([second[0], first[0]], plain.counts, 8, plain.key, start=[0, cursor]).batch(b)
        assert (s == s2[b * 8:(b + 1) * 8]).all() and (r == r2[b * 8:(b + 1) * 8]).all()
