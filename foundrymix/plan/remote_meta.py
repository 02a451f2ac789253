"""A remote stream's metadata kept current: ``foundrymix.json`` and ``index.json`` fetched
afresh on every start, so a dataset re-uploaded to the same prefix is never read through
stale cached shards."""

from __future__ import annotations

import contextlib
import filecmp
import logging
import os
from typing import Any

from foundrymix.config import ConfigError
from foundrymix.format.schema import MANIFEST_NAME
from foundrymix.format.shards import INDEX_NAME, read_index
from foundrymix.plan.config import LoaderConfig
from foundrymix.s3.remote import RemoteError, download, local_denied

logger = logging.getLogger(__name__)


def sync_remote(config: LoaderConfig, name: str, where: str) -> None:
    """Fetch a remote stream's manifest and index afresh, so no stale shard is read: if they
    changed, foundrymix's own cache drops the old index's shards (warning), a ``local:`` the
    user named is refused. An unreachable remote raises even with a cached copy, which might
    be stale. Each rank downloads into files of its own and renames them into place."""
    remote_dir = config.stream_remote_dir(name)
    assert remote_dir is not None
    directory = config.stream_dir(name)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise local_denied(e, os.path.join(directory, INDEX_NAME)) or e from None
    # a stream given a tokenizer is LLM-Foundry token shards: no manifest to fetch
    wanted = (INDEX_NAME,) if config.streams[name].tokenizer else (MANIFEST_NAME, INDEX_NAME)
    fresh = {b: os.path.join(directory, f'{b}.part-{os.getpid()}') for b in wanted}
    try:
        for basename, part in list(fresh.items()):
            url = f'{remote_dir.rstrip("/")}/{basename}'
            try:
                download(url, part, config.download_timeout)
            except RemoteError as e:
                if e.kind == 'not_found' and basename == MANIFEST_NAME and config.tokenizer:
                    del fresh[basename]  # perhaps LLM-Foundry token shards: the index says
                    continue
                raise _remote_error(config, name, where, basename, e) from e
        cached = [b for b in fresh if os.path.isfile(os.path.join(directory, b))]
        filecmp.clear_cache()  # its memo keys on (size, mtime): never trusted for a safety check
        changed = [b for b, part in fresh.items()
                   if b not in cached or not filecmp.cmp(part, os.path.join(directory, b), shallow=False)]
        if cached and changed:
            _remote_changed(config, name, where, directory, remote_dir, changed)
        for basename, part in fresh.items():  # the index last: it names the shards
            os.replace(part, os.path.join(directory, basename))
    finally:
        for part in fresh.values():
            if os.path.exists(part):
                os.remove(part)

def _remote_error(config: LoaderConfig, name: str, where: str, basename: str, e: Any) -> ConfigError:
    remote_dir, directory = config.stream_remote_dir(name), config.stream_dir(name)
    if e.kind == 'not_found' and basename == MANIFEST_NAME:
        return ConfigError(
            f'{where}: no foundrymix manifest at {e.url} ({e.code}: no such object). Check '
            f'that remote {remote_dir!r} (bucket and path) is right and holds a whole '
            f'directory made by `foundrymix convert` ({MANIFEST_NAME}, {INDEX_NAME} and shards)')
    if e.kind == 'not_found':
        return ConfigError(
            f'{where}: no {INDEX_NAME} at {e.url} ({e.code}: no such object), though '
            f'{MANIFEST_NAME} is there: an incomplete conversion or upload? Re-run '
            f'`foundrymix convert` into {remote_dir!r} (it uploads {INDEX_NAME} last)')
    cached = os.path.isfile(os.path.join(directory, INDEX_NAME))
    note = (f' (a copy is cached in {directory}, but without the remote nothing tells '
            f'whether it is current, so it is not used)' if cached else '')
    return ConfigError(f'{where}: cannot read {e}{note}')

def _remote_changed(config: LoaderConfig, name: str, where: str, directory: str, remote_dir: str,
                    changed: list[str]) -> None:
    """The remote's metadata differs from the local copy: refresh our cache, or refuse."""
    spec = config.streams[name]
    what = ' and '.join(changed)
    if spec.local:
        raise ConfigError(
            f'{where}: remote {remote_dir} changed since local {directory} was filled ({what} '
            f'differ): its shard files are stale, and streaming would read them as the new '
            f"dataset's. foundrymix never deletes files in a directory you named in local:; "
            f'delete {directory} (to download the new dataset there), point local: at an '
            f"empty directory, or leave local: out to use foundrymix's cache (refreshed "
            f'when its remote changes)')
    removed = 0
    try:
        old = read_index(os.path.join(directory, INDEX_NAME))
    except ValueError:
        old = {'shards': []}  # no readable old index: nothing it named can be trusted
    for shard in old['shards']:
        for key in ('raw_data', 'zip_data'):
            info = shard.get(key)
            if not info:
                continue
            base = os.path.join(directory, info['basename'])
            for path in (base, base + '.tmp'):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed += 1
    logger.warning('%s: remote %s changed since the cache %s was filled (%s differ): '
                   'fetched the new metadata and removed %d stale cached shard file(s)',
                   where, remote_dir, directory, what, removed)
