"""The shuffle window under ``cache_limit`` (plan/window.py), without S3: the bytes a window can
span are checked against the windows :class:`StreamDraws` really makes, pass after pass; the
window chosen is the largest that fits; a limit or ``shuffle_block_size`` that cannot fit is
refused in one line saying what fits. (tests/loader/test_cache_window.py reads through it.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from foundrymix.config import ConfigError
from foundrymix.plan.order import WINDOW_ROWS, StreamDraws
from foundrymix.plan.window import ROOM_SHARDS, cache_need, cache_window, fixed_bytes, window_bytes


def shards(rows: list[int], sizes: list[int]) -> list[dict]:
    return [{'samples': r, 'raw_data': {'basename': f'shard.{k:05}.mds', 'bytes': b,
                                        'hashes': {'xxh3_64': 'f' * 16}}}
            for k, (r, b) in enumerate(zip(rows, sizes))]


def info(name: str, rows: list[int], sizes: list[int], tmp_path) -> SimpleNamespace:
    return SimpleNamespace(name=name, remote_dir=f's3://b/{name}', directory=str(tmp_path / name),
                           where=f'train_loader.streams.{name}', index={'shards': shards(rows, sizes)})


def test_window_bytes_bounds_every_window_streamdraws_makes():
    """Brute force: every window of 40 passes of random shard orders, at many window sizes,
    spans at most ``window_bytes``; and the bound is met by some window (it is tight)."""
    rng = np.random.default_rng(5)
    rows = rng.integers(1, 60, 23).tolist()
    sizes = rng.integers(1_000, 9_000, 23).tolist()
    met = 0
    for W in (1, 2, 17, 40, 59, 60, 61, 100, 333, sum(rows), WINDOW_ROWS):
        draws = StreamDraws(rows, (1, 2, 3), W)
        bound = window_bytes(shards(rows, sizes), W)
        seen = 0
        for p in range(40):
            order, _, first = draws._pass_layout(p)
            for a, b in zip(first, [*first[1:], len(order)]):
                seen = max(seen, sum(sizes[s] for s in order[a:b]))
        assert seen <= bound, (W, seen, bound)
        met += seen == bound
    assert met >= 3  # W = 1 and the whole stream, at least


def test_the_default_window_is_kept_when_it_fits_and_the_largest_that_fits_chosen_otherwise(tmp_path):
    a = info('a', [100] * 14, [90_000] * 14, tmp_path)
    b = info('b', [50] * 9, [40_000] * 9, tmp_path)
    fixed = fixed_bytes(a) + fixed_bytes(b)
    cfg = SimpleNamespace(shuffle=True, cache_limit=None, shuffle_block_size=None)
    assert cache_window(cfg, [a, b]) == WINDOW_ROWS
    everything = 14 * 90_000 + 9 * 40_000 + ROOM_SHARDS * 90_000 + fixed
    assert cache_window(SimpleNamespace(shuffle=True, cache_limit=everything, shuffle_block_size=None), [a, b]) == WINDOW_ROWS
    # A window of W rows spans up to 1 + (W - 1) // 100 shards of a and 1 + (W - 1) // 50 of b:
    # room for 390,000 bytes of them holds 2 + 4 shards (340,000) up to W = 200; 3 + 5 do not fit.
    limit = 3 * 90_000 + 3 * 40_000 + ROOM_SHARDS * 90_000 + fixed
    W = cache_window(SimpleNamespace(shuffle=True, cache_limit=limit, shuffle_block_size=None), [a, b])
    assert W == 200
    assert cache_need([a, b])(W) <= limit < cache_need([a, b])(W + 1)
    assert cache_window(SimpleNamespace(shuffle=True, cache_limit=f'{limit}b', shuffle_block_size=200), [a, b]) == 200
    # unshuffled, the window changes nothing (rows in shard order, one shard at a time): kept
    assert cache_window(SimpleNamespace(shuffle=False, cache_limit=limit, shuffle_block_size=None), [a, b]) == WINDOW_ROWS


def test_a_shuffle_block_size_that_cannot_fit_is_refused_saying_what_fits(tmp_path):
    a = info('a', [100] * 14, [90_000] * 14, tmp_path)
    limit = 4 * 90_000 + ROOM_SHARDS * 90_000 + fixed_bytes(a)
    with pytest.raises(ConfigError) as err:
        cache_window(SimpleNamespace(shuffle=True, cache_limit=limit, shuffle_block_size=1200), [a])
    need = 12 * 90_000 + ROOM_SHARDS * 90_000 + fixed_bytes(a)  # 1,199 rows hold 11 shards, + 1
    assert str(err.value) == (
        f"train_loader.shuffle_block_size: windows of 1,200 rows need a cache of {need:,} bytes "
        f"(every remote stream's window at once, room to fetch and the index files), and "
        f'cache_limit {limit:,} holds windows of 400 rows; each shard would be fetched many times '
        f'a pass. Set shuffle_block_size to at most 400 (or leave it out: the largest window that '
        f'fits is used), or raise cache_limit to at least {need:,}')
    assert '\n' not in str(err.value)


def test_a_limit_below_one_shard_of_each_stream_is_refused(tmp_path):
    a = info('a', [100] * 14, [90_000] * 14, tmp_path)
    b = info('b', [50] * 9, [40_000] * 9, tmp_path)
    fixed = fixed_bytes(a) + fixed_bytes(b)
    need = 90_000 + 40_000 + ROOM_SHARDS * 90_000 + fixed
    with pytest.raises(ConfigError) as err:
        cache_window(SimpleNamespace(shuffle=True, cache_limit=need - 1, shuffle_block_size=None), [a, b])
    assert str(err.value) == (
        f'train_loader.cache_limit: {need - 1:,} bytes is below what the loader needs to read these '
        f'streams, {need:,} bytes: a shard of each of the 2 remote stream(s) at once (130,000 bytes), '
        f"room to fetch 3 more of the largest (90,000 bytes, stream 'a', shard.00000.mds) and the "
        f'index and hash-record files ({fixed:,} bytes). Raise cache_limit to at least {need:,}, or '
        f'convert with a smaller --size-limit')
    # windows of up to 50 rows span one shard of each (b has 50 rows a shard)
    assert cache_window(SimpleNamespace(shuffle=True, cache_limit=need, shuffle_block_size=None), [a, b]) == 50
    with pytest.raises(ConfigError, match=r"cache_limit: 'lots' is not a size"):
        cache_window(SimpleNamespace(shuffle=True, cache_limit='lots', shuffle_block_size=None), [a, b])


def test_a_window_chosen_for_cache_limit_is_in_the_fingerprint_so_a_resume_cannot_change_it(tmp_path):
    """Another window is another order: a checkpoint of the run without cache_limit (or with
    another) differs in ``shuffle_block_size``, naming both values; a limit whose window is the
    default changes nothing, and the chosen window set explicitly matches it."""
    from foundrymix.plan.stages import fingerprint_changes, stage_fingerprint
    a = info('a', [100] * 14, [90_000] * 14, tmp_path)
    a.spec = SimpleNamespace(repeat=1, proportion=None, choose=None)

    def fp(**knobs):
        cfg = SimpleNamespace(shuffle=True, shuffle_seed=1, shuffle_block_size=None, batching_method='random',
                              epoch_size=None, weights_in='rows', adaptive=None, cache_limit=None)
        cfg.__dict__.update(knobs)
        return stage_fingerprint(cfg, [a], 8)
    tight = 4 * 90_000 + ROOM_SHARDS * 90_000 + fixed_bytes(a)
    assert fingerprint_changes(fp(), fp(cache_limit=tight)) == ['shuffle_block_size None -> 400']
    assert fingerprint_changes(fp(), fp(cache_limit='1gb')) == []
    assert fingerprint_changes(fp(cache_limit=tight), fp(cache_limit='1gb', shuffle_block_size=400)) == []
