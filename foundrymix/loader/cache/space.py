"""Whether the shards fit and are whole: cached shards checked against ``index.json``,
``cache_limit`` and the cache disk's free space -- before the first batch.

Part of :mod:`foundrymix.loader.cache` (see its docstring for why).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from foundrymix.config import ConfigError

log = logging.getLogger(__name__)

#: boto3/s3transfer writes ``<file>.<8 hex>`` and renames; other backends ``<file>.tmp``
_PARTIAL = re.compile(r'^(?P<base>.+)\.(?:[0-9A-Fa-f]{8}|tmp)$')


def _shard_sizes(shard: dict[str, Any]) -> tuple[str, int, int]:
    raw = shard['raw_data']
    zip_ = shard.get('zip_data') or {}
    return raw['basename'], int(raw['bytes']), int(zip_.get('bytes', 0))


def _present(directory: str, shard: dict[str, Any]) -> bool:
    for key in ('raw_data', 'zip_data'):
        f = shard.get(key)
        if f:
            try:
                if os.stat(os.path.join(directory, f['basename'])).st_size == int(f['bytes']):
                    return True
            except OSError:
                pass
    return False


def remove_shard_files(directory: str, basenames: list[str]) -> list[str]:
    """Remove the named shard files of a cache and their partial copies; what was removed.

    Partial copies: ``<file>.tmp`` (streaming's decompression and non-S3 downloads) and
    ``<file>.<8 hex>`` (boto3's temporary name). Only for a remote stream's cache: the
    files are copies of the remote's, downloaded again when needed.
    """
    removed = []
    try:
        listing = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in sorted(listing):
        partial = _PARTIAL.match(entry)
        if entry in basenames or (partial and partial.group('base') in basenames):
            remove_plain_file(os.path.join(directory, entry), removed)
    return removed


def remove_plain_file(path: str, removed: list[str]) -> None:
    """Remove ``path`` if it is a regular file (never a link or a directory: what it points
    to may be the user's); append it to ``removed``. Gone already is fine."""
    try:
        if os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            removed.append(path)
    except FileNotFoundError:
        pass


@dataclass
class CacheCheck:
    """What :func:`check_cached` did to one stream's cache."""

    removed: list[str] = field(default_factory=list)  #: files removed (bad size or hash)
    hashed_bytes: int = 0  #: bytes of cached shard files hashed
    hash_seconds: float = 0.0


def check_cached(name: str, directory: str, index: dict[str, Any],
                 validate_hash: Optional[str]) -> CacheCheck:
    """Remove the cached shard files of a remote stream that do not match ``index.json``.

    Why: streaming (0.13, ``Stream._prepare_shard_part`` and ``Reader.set_up_local``)
    counts a shard as present when its file *exists*, and checks ``validate_hash`` only
    right after a download. A shard truncated in the cache (a full disk, a copy
    interrupted outside streaming) or changed in place, and one that failed its hash in
    an earlier run, was read as it was: the rows of a damaged file, trained on. Here every
    cached file of the index must have its recorded size and, with ``validate_hash``, its
    recorded hash (each file is hashed once, at the start of the run, by the node's first
    process: the cost is one read of the cache -- measured on 64 MB shards on the shared
    2-core test machine, xxh3_64 hashes 4.5-8.9 GB/s in memory, and the check ran at
    2.1-8 GB/s from the page cache and 0.6-1.3 GB/s from disk). A file that does not
    match is removed with its partial copies (a warning names it): streaming then
    downloads it again, and checks the new copy's hash.
    """
    result = CacheCheck()
    start = time.monotonic()
    for shard in index.get('shards', []):
        for key in ('raw_data', 'zip_data'):
            info = shard.get(key)
            if not info:
                continue
            path = os.path.join(directory, info['basename'])
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            expected = (info.get('hashes') or {}).get(validate_hash) if validate_hash else None
            if size != int(info['bytes']):
                problem = f'{size:,} bytes, index.json records {int(info["bytes"]):,}'
            elif expected is not None:
                result.hashed_bytes += size
                if file_hash(path, size, validate_hash) == expected:
                    continue
                problem = f'its {validate_hash} hash does not match the one index.json records'
            else:
                continue
            removed = remove_shard_files(directory, [info['basename']])
            result.removed += removed
            log.warning("stream '%s': cached shard file %s: %s; removed it (%s), it is downloaded "
                        'again when needed', name, path, problem, ', '.join(removed))
    result.hash_seconds = time.monotonic() - start
    if result.hashed_bytes:
        log.info("stream '%s': hashed %s bytes of cached shards (%s) in %.2f s", name,
                 f'{result.hashed_bytes:,}', validate_hash, result.hash_seconds)
    return result


def file_hash(path: str, size: int, algorithm: str) -> str:
    """streaming's ``get_hash`` of a file, read through ``mmap``: no copy of the file in
    memory (measured on 64 MB shards from the page cache: 2.1-8 GB/s, against 0.3-1.1 GB/s
    for ``read()`` then hash, on the shared 2-core test machine)."""
    import mmap

    from foundrymix.format.streaming_format import get_hash
    if size == 0:
        return get_hash(algorithm, b'')
    with open(path, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return get_hash(algorithm, data)


def min_cache_limit(infos: list[Any]) -> tuple[int, str, str, int]:
    """streaming's minimum ``cache_limit`` for these streams, and the shard that sets it.

    Returns (minimum bytes, stream, shard file, that shard's raw + zip bytes). streaming
    (0.13, ``StreamingDataset.__init__``) requires ``cache_limit >= 4 x`` the largest
    shard of *any* stream of the dataset (raw plus compressed size: a compressed shard is
    held in both forms while it is decompressed) and ``cache_limit >`` the bytes of all
    ``index.json`` files (counted in the cache). Its eviction then works: before each
    download it evicts the least recently used downloaded shards until the new shard's
    raw + zip size fits, so at any moment the cache holds at most ``cache_limit``.
    """
    best = (0, '', '', 0)
    index_bytes = 0
    for info in infos:
        try:
            index_bytes += os.stat(os.path.join(info.directory, 'index.json')).st_size
        except OSError:
            index_bytes += len(json.dumps(info.index))
        for shard in info.index['shards']:
            name, raw, zip_ = _shard_sizes(shard)
            if raw + zip_ > best[3]:
                best = (0, info.name, name, raw + zip_)
    return max(4 * best[3], index_bytes + 1), best[1], best[2], best[3]


def check_space(config: Any, infos: list[Any], where: str) -> None:
    """Refuse, before the first batch, a ``cache_limit`` streaming cannot work with and a
    cache disk without room for what the run downloads.

    The need on a filesystem is the bytes of the shards its remote streams do not hold
    yet (raw form, plus compressed if ``keep_zip``, plus room for one compressed shard
    being unpacked), capped by ``cache_limit`` when set: with a limit streaming evicts
    shards so the cache never holds more.
    """
    from foundrymix.loader.streaming_compat import bytes_to_int
    limit = config.cache_limit
    if isinstance(limit, str):
        try:
            limit = bytes_to_int(limit)
        except (ValueError, KeyError) as e:
            raise ConfigError(f'{where}.cache_limit: {config.cache_limit!r} is not a size '
                              f'(bytes, or e.g. "200mb", "10gb")') from e
    local_only = [i.name for i in infos if not i.remote_dir]
    if limit and local_only:
        # streaming (0.13) evicts the coldest shard of *any* stream to stay under the limit:
        # a stream without a remote has only its local files, and they would be deleted.
        raise ConfigError(
            f'{where}.cache_limit: stream(s) {", ".join(local_only)} have no remote, and streaming '
            f'would evict -- delete -- their shard files to keep the cache under the limit. '
            f'cache_limit is for streams read from a remote: remove it, or read those streams '
            f'with a remote: and a local: cache directory')
    if limit:
        minimum, stream, shard, size = min_cache_limit(infos)
        if limit < minimum:
            raise ConfigError(
                f'{where}.cache_limit: {limit:,} bytes is below what streaming needs to read '
                f'these streams, {minimum:,} bytes: 4 x the largest shard ({size:,} bytes, '
                f"stream '{stream}', {shard}; streaming keeps room to download and unpack "
                f'shards while others are read). Raise cache_limit to at least {minimum:,}, or '
                f'convert with a smaller --size-limit')
    by_fs: dict[int, list[tuple[Any, int, int]]] = {}
    for info in infos:
        if not info.remote_dir:
            continue
        missing = 0
        unpack = 0
        for shard in info.index['shards']:
            if _present(info.directory, shard):
                continue
            _, raw, zip_ = _shard_sizes(shard)
            missing += raw + (zip_ if config.keep_zip else 0)
            unpack = max(unpack, zip_)
        os.makedirs(info.directory, exist_ok=True)
        by_fs.setdefault(os.stat(info.directory).st_dev, []).append((info, missing, unpack))
    for streams in by_fs.values():
        missing = sum(m for _, m, _ in streams) + max(u for _, _, u in streams)
        need = min(limit, missing) if limit else missing
        directory = os.path.commonpath([i.directory for i, _, _ in streams])
        free = shutil.disk_usage(streams[0][0].directory).free
        if free < need:
            names = ', '.join(f"'{i.name}' ({m:,} bytes)" for i, m, _ in streams)
            capped = f', capped by cache_limit {limit:,}' if limit and limit < missing else ''
            raise ConfigError(
                f'{where}: the cache directory {directory} has {free:,} bytes free, and this run '
                f'downloads {need:,} bytes into it (shards not cached yet of stream {names}'
                f'{capped}). Free space there, set {where}.cache_limit (streaming then evicts '
                f'shards as it goes; at least {min_cache_limit([i for i, _, _ in streams])[0]:,} '
                f'bytes), or point {where}.cache_root (or the stream\'s local:) at a larger disk')


def disk_full_hint(text: str, directory: str) -> str:
    """What to say after a shard download failed with a full disk (empty if it did not)."""
    if 'No space left' not in text and f'[Errno {errno.ENOSPC}]' not in text:
        return ''
    try:
        free = f'{shutil.disk_usage(directory).free:,} bytes free now'
    except OSError:
        free = 'free space unknown'
    return (f'; the cache disk is full ({directory}: {free}): set train_loader.cache_limit so '
            f'streaming evicts shards, or point cache_root at a larger disk')
