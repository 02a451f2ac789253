"""The shuffle window under ``cache_limit`` (docs/s3.md): every stream's window is in use at
once, so the cache must hold them all, plus room to fetch and what it keeps beside the shards,
or shards are fetched again and again. A window that does not fit is refused; without
``shuffle_block_size`` the largest one that fits (at most the default) is used."""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np

from foundrymix.config import ConfigError
from foundrymix.format.mds import size_limit_bytes
from foundrymix.plan.order import WINDOW_ROWS

#: room to fetch: this many of the largest shard (raw + compressed) beside the windows
ROOM_SHARDS = 3
#: lines a shard-hash record may hold beyond one per cached shard before it is compacted
RECORD_SLACK = 32


def limit_bytes(config: Any, where: str) -> int:
    """``cache_limit`` in bytes (0: none); a value that is not a size is refused."""
    try:
        return size_limit_bytes(config.cache_limit) if config.cache_limit else 0
    except (ValueError, KeyError) as e:
        raise ConfigError(f'{where}.cache_limit: {config.cache_limit!r} is not a size '
                          f'(bytes, or e.g. "200mb", "10gb")') from e


def shard_bytes(shard: dict[str, Any]) -> int:
    return sum(int(shard[k]['bytes']) for k in ('raw_data', 'zip_data') if shard.get(k))


def record_bytes(shards: Sequence[dict[str, Any]]) -> int:
    """The most a stream's shard-hash record (and its copy while compacted) holds: a line per
    cached shard plus :data:`RECORD_SLACK`, each at most its longest name and hash plus 160."""
    if not shards:
        return 0
    line = 160 + max(len(s['raw_data']['basename']) + max(map(len, (s['raw_data'].get('hashes') or {'': ''}).values()))
                     for s in shards)
    return 2 * (len(shards) + RECORD_SLACK + 1) * line


def fixed_bytes(info: Any) -> int:
    """What the cache keeps of a stream beside its shards, from its index alone (so the window
    chosen is the same at every start): the hash record's bound, twice the index, plus 8 KiB."""
    return record_bytes(info.index['shards']) + 2 * len(json.dumps(info.index)) + 8192


def window_bytes(shards: Sequence[dict[str, Any]], rows: int) -> int:
    """The most bytes one window of ``rows`` rows can span: one shard plus the most whose rows
    sum to under ``rows``, counted as the largest shards."""
    counts = np.sort(np.array([int(s['samples']) for s in shards], np.int64))
    m = 1 + int(np.searchsorted(np.cumsum(counts), max(rows, 1) - 1, side='right'))
    sizes = sorted((shard_bytes(s) for s in shards), reverse=True)
    return int(sum(sizes[:m]))


def largest_shard(infos: Sequence[Any]) -> tuple[int, str, str]:
    """(raw + compressed bytes, stream, shard file) of the largest shard of ``infos``."""
    return max(((shard_bytes(s), i.name, s['raw_data']['basename']) for i in infos for s in i.index['shards']),
               key=lambda t: t[0], default=(0, '', ''))  # the first of the largest


def cache_need(infos: Sequence[Any]) -> Callable[[int], int]:
    """Window rows -> the bytes a cache of the remote streams ``infos`` needs for windows of that
    many rows: every stream's window, room to fetch :data:`ROOM_SHARDS` of the largest shard, and
    the fixed files."""
    room = ROOM_SHARDS * largest_shard(infos)[0] + sum(fixed_bytes(i) for i in infos)
    return lambda rows: room + sum(window_bytes(i.index['shards'], rows) for i in infos)


def cache_window(config: Any, infos: Sequence[Any]) -> int:
    """The stage's shuffle window in rows: ``shuffle_block_size`` or the default, or under
    ``cache_limit`` the largest up to the default whose windows of every remote stream fit beside
    the fetch room and fixed files; a ``shuffle_block_size`` or limit that cannot fit is refused."""
    asked = config.shuffle_block_size or WINDOW_ROWS
    remote = [i for i in infos if i.remote_dir]
    where = infos[0].where.rsplit('.streams.', 1)[0] if infos else 'train_loader'
    limit = limit_bytes(config, where)
    if not limit or not remote:
        return asked
    need = cache_need(remote)
    if need(asked if config.shuffle else 1) <= limit:  # unshuffled: a shard of each at a time
        return asked
    if need(1) > limit:
        size, stream, shard = largest_shard(remote)
        fixed = sum(fixed_bytes(i) for i in remote)
        raise ConfigError(
            f'{where}.cache_limit: {limit:,} bytes is below what the loader needs to read these '
            f'streams, {need(1):,} bytes: a shard of each of the {len(remote)} remote '
            f'stream(s) at once ({need(1) - fixed - ROOM_SHARDS * size:,} bytes), room to '
            f"fetch {ROOM_SHARDS} more of the largest ({size:,} bytes, stream '{stream}', {shard}) and "
            f'the index and hash-record files ({fixed:,} bytes). Raise cache_limit to at least '
            f'{need(1):,}, or convert with a smaller --size-limit')
    lo, hi = 1, asked  # windows of lo rows fit, of hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid)
    if config.shuffle_block_size:
        raise ConfigError(
            f'{where}.shuffle_block_size: windows of {asked:,} rows need a cache of '
            f'{need(asked):,} bytes (every remote stream\'s window at once, room to fetch '
            f'and the index files), and cache_limit {limit:,} holds windows of {lo:,} rows; each shard '
            f'would be fetched many times a pass. Set shuffle_block_size to at most {lo:,} (or leave it '
            f'out: the largest window that fits is used), or raise cache_limit to at least '
            f'{need(asked):,}')
    return lo
