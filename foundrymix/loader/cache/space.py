"""Whether the shards fit: ``cache_limit`` and the cache disk's free space, checked before the
first batch."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Any

from foundrymix.config import ConfigError
from foundrymix.plan.window import cache_need, cache_window, limit_bytes


def _shard_sizes(shard: dict[str, Any]) -> tuple[str, int, int]:
    raw = shard['raw_data']
    zip_ = shard.get('zip_data') or {}
    return raw['basename'], int(raw['bytes']), int(zip_.get('bytes', 0))


def _present(directory: str, shard: dict[str, Any]) -> bool:
    for key in ('raw_data', 'zip_data'):
        f = shard.get(key)
        if f:
            with contextlib.suppress(OSError):
                if os.stat(os.path.join(directory, f['basename'])).st_size == int(f['bytes']):
                    return True
    return False


def remove_plain_file(path: str, removed: list[str]) -> None:
    """Remove ``path`` if it is a regular file (never a link or a directory: what it points
    to may be the user's); append it to ``removed``. Gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            removed.append(path)


def check_space(config: Any, infos: list[Any], where: str) -> None:
    """Refuse a ``cache_limit`` the loader cannot work with, and a filesystem without room for
    the shards not cached yet (raw, compressed too with ``keep_zip``, one being unpacked),
    capped by ``cache_limit`` (the loader then evicts)."""
    limit = limit_bytes(config, where)
    local_only = [i.name for i in infos if not i.remote_dir]
    if limit and local_only:
        raise ConfigError(
            f'{where}.cache_limit: stream(s) {", ".join(local_only)} have no remote, and the '
            f'loader would evict -- delete -- their shard files to keep the cache under the limit. '
            f'cache_limit is for streams read from a remote: remove it, or read those streams '
            f'with a remote: and a local: cache directory')
    cache_window(config, infos)  # refuses a limit the windows do not fit
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
                f'{capped}). Free space there, set {where}.cache_limit (the loader then evicts '
                f'shards as it goes; at least {cache_need([i for i, _, _ in streams], 1):,} '
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
            f'the loader evicts shards, or point cache_root at a larger disk')
