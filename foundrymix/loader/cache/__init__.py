"""The node-local cache of remote streams. A run claims its cache directories while it reads them
(two live runs never share one: each evicts under its own ``cache_limit``), cleans what dead runs
left in a freshly claimed one, and refuses a cache too small -- all before the first batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import filecmp
import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Optional

from foundrymix import claims
from foundrymix.config import ConfigError
from foundrymix.format.advice import read_index_or_none
from foundrymix.format.shards import index_files
from foundrymix.loader.cache.hashes import CorruptLocalShardError  # noqa: F401 (re-exported)
from foundrymix.loader.cache.hashes import CacheBudget, cache_file, hash_algorithm, write_atomic
from foundrymix.plan.config import cache_base
from foundrymix.plan.window import cache_need, cache_window, limit_bytes, record_bytes, window_bytes

log = logging.getLogger(__name__)

#: candidate directories tried for one default-cache directory before giving up
MAX_CANDIDATES = 64


def claim(home: str, shared_default: bool, where: str) -> claims.Claim:
    """Claim (an ``flock``, released when the process dies) ``home`` or, for the default cache
    (``shared_default``), its first sibling no other live run holds (ranks of one job share it); a
    named ``local:`` another run holds is refused. The claim is ``fresh`` when no live run held it
    before (what dead runs left may be cleaned)."""
    configured, home = home, claims.normalize(home)
    paths = [home] + [f'{home}-run{k + 1}' for k in range(1, MAX_CANDIDATES if shared_default else 1)]
    me = claims.run_id()
    busy: list[claims.Busy] = []
    with claims.guard(home, '.group'):  # two runs starting at once never pick the same directory
        # First a directory this run already holds (another rank of the same job), then a free one.
        for path in paths:
            owner = claims.exclusive_owner(path)
            if owner is not None and owner.run == me:
                return claims.try_claim(path, claims.EXCLUSIVE)
        for path in paths:
            try:
                got = claims.try_claim(path, claims.EXCLUSIVE)
            except claims.Busy as e:
                busy.append(e)
                continue
            if path != home:
                log.warning('%s: cache directory %s is in use by another live run (%s); this run '
                            'uses %s (its shards are downloaded again)', where, configured,
                            busy[0].holders[0].run if busy and busy[0].holders else 'unknown', path)
            return got
    holders = busy[0].holders if busy else []
    who = holders[0].who() if holders else 'a run'
    if not shared_default:
        raise ConfigError(
            f'{where}.local: {configured} is in use by another live run, {who}. Two runs do not '
            f'share one cache directory at once (each may evict the other\'s shards under its '
            f'cache_limit, and each cleans what dead runs left there). Give this run its own '
            f'local: directory, or leave local: out to use the default cache, which gives '
            f'runs that overlap in time a directory each')
    raise ConfigError(f'{where}: all {MAX_CANDIDATES} cache directories for {configured} are in use '
                      f'by live runs (e.g. {who}); set cache_root to another directory')


_PART_PID = re.compile(r'^(?P<base>.+)\.part-(?P<pid>\d+)(?:-[0-9a-f]+)?$')
_PARTIAL = re.compile(r'^(?P<base>.+)\.(?:[0-9A-Fa-f]{8}|tmp)$')


def clean_stale(directory: str, stream_dirs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Remove from each (stream directory, index) of ``directory`` what dead runs left:
    ``<file>.part-<pid>[-<hex>]`` of a dead process (older ``<file>.tmp`` and boto3's
    ``<file>.<8 hex>`` too) whose file the index names; only regular files (never a link: what
    it points to may be the user's). Call only on a directory no live run holds."""
    removed: list[str] = []
    for stream_dir, index in stream_dirs:
        names = {'index.json', 'foundrymix.json'} | index_files(index)
        try:
            listing = os.listdir(stream_dir)
        except FileNotFoundError:
            continue
        for entry in listing:
            part, partial = _PART_PID.match(entry), _PARTIAL.match(entry)
            if part:
                stale = part.group('base') in names and not claims.pid_alive(int(part.group('pid')))
            else:
                stale = bool(partial) and partial.group('base') in names
            path = os.path.join(stream_dir, entry)
            with contextlib.suppress(FileNotFoundError):
                if stale and os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)
                    removed.append(path)
    if removed:
        log.warning('cache %s: removed what dead runs left: %s', directory, ', '.join(removed))
    return removed


def has_file(path: str, size: Any) -> bool:
    """Whether ``path`` is there with ``size`` bytes."""
    try:
        return os.stat(path).st_size == int(size)
    except OSError:
        return False


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
            files = [f for f in (shard['raw_data'], shard.get('zip_data')) if f]
            if any(has_file(os.path.join(info.directory, f['basename']), f['bytes']) for f in files):
                continue
            raw, zip_ = int(files[0]['bytes']), int(files[1]['bytes']) if len(files) > 1 else 0
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
                f'shards as it goes; at least {cache_need([i for i, _, _ in streams])(1):,} '
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


@dataclass
class Source:
    """One stream's shard files: read in ``directory``, fetched from ``remote`` (a remote, or a
    compressed local stream's directory) if set."""

    name: str
    directory: str
    remote: Optional[str]
    shards: list[dict[str, Any]]
    algorithm: Optional[str]  #: hash checked on first open (None: no check)
    #: LLM-Foundry token rows read in place: (file dtype, document rule, separator id, row length,
    #: token dtype of the rows made of them)
    foundry: Optional[tuple[str, str, Optional[int], int, str]] = None
    #: ``remote`` is the user's own compressed local stream (damage there is fixed there, not uploaded)
    local: bool = False


def sources_of(infos: list[Any], config: Any) -> list[Source]:
    """The stores' sources for catalog infos (after the cache claimed their directories): a
    remote stream read in its cache directory; a compressed local stream unpacked into the
    foundrymix cache (never the user's directory); an uncompressed local stream where it is."""
    out = []
    for info in infos:
        shards = info.index['shards']
        algo = hash_algorithm(config, info.index)
        if info.remote_dir:
            out.append(Source(info.name, info.directory, info.remote_dir, shards, algo))
        elif any(s.get('zip_data') for s in shards):
            unpacked = cache_file(config.cache_root, 'unpacked', info.directory)
            out.append(Source(info.name, unpacked, info.directory, shards, algo, local=True))
        else:
            out.append(Source(info.name, info.directory, None, shards, algo))
        m = info.manifest
        if m.options.get('format') == 'llm-foundry-tokens':
            out[-1].foundry = (m.options['file_dtype'], m.options['documents'], m.options['separator'],
                               m.max_seq_len, m.token_dtype)
    return out


def prepare(config: Any, infos: list[Any], where: str) -> tuple[list[Any], claims.ClaimSet]:
    """Claim, clean and check the cache directory of every remote stream: the infos to build the
    store from (``local`` may now be a sibling of the configured one) and the claims."""
    held = claims.ClaimSet()
    out = []
    try:
        for info in infos:
            if not info.remote_dir:
                out.append(info)
                continue
            got = claim(info.local, not info.spec.local, f'{where}.streams.{info.name}')
            held.held.append(got)
            if os.path.normpath(got.path) != os.path.normpath(claims.normalize(info.local)):
                info = _moved(info, got.path)  # a sibling of the configured directory
            if got.fresh:
                clean_stale(info.local, [(info.directory, info.index)])
            out.append(info)
        check_space(config, out, where)
    except BaseException:
        held.release()
        raise
    return out, held


def budget_for(config: Any, infos: list[Any], where: str) -> Optional[Any]:
    """The remote streams' :class:`~.hashes.CacheBudget` (None without ``cache_limit``): each
    stream may keep its shuffle window, the files kept beside the shards counted; its lock named
    by the directories it covers."""
    if not config.cache_limit:
        return None
    remote = [i for i in infos if i.remote_dir]
    rows = cache_window(config, infos) if config.shuffle else 1  # unshuffled: a shard at a time
    dirs = sorted(os.path.realpath(i.directory) for i in remote)
    key = hashlib.blake2s('\n'.join(dirs).encode('utf-8'), digest_size=10).hexdigest()
    return CacheBudget(limit_bytes(config, where),
                       [(i.directory, i.index['shards'], window_bytes(i.index['shards'], rows)) for i in remote],
                       sum(record_bytes(i.index['shards']) + _metadata_bytes(i.directory) for i in remote),
                       os.path.join(cache_base(config.cache_root), 'budgets', f'{key}.lock'))


def _metadata_bytes(directory: str) -> int:
    """The bytes of a cached stream's ``index.json`` and ``foundrymix.json`` (written at start)."""
    out = 0
    for name in ('index.json', 'foundrymix.json'):
        with contextlib.suppress(OSError):
            out += os.stat(os.path.join(directory, name)).st_size
    return out


def _moved(info: Any, local: str) -> Any:
    """``info`` read from another directory, its metadata copied there; shard files an earlier
    run left there under another index are removed first (the directory is ours, claimed)."""
    split = info.spec.split
    directory = os.path.join(local, split) if split else local
    os.makedirs(directory, exist_ok=True)
    filecmp.clear_cache()  # its memo keys on (size, mtime): never trusted for a safety check
    for name in ('foundrymix.json', 'index.json'):
        src, dst = os.path.join(info.directory, name), os.path.join(directory, name)
        there = os.path.isfile(dst)
        if there and filecmp.cmp(src, dst, shallow=False):
            continue
        if there and name == 'index.json':
            for old in index_files(read_index_or_none(dst) or {}):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, old))
        with open(src, 'rb') as f:
            write_atomic(dst, f.read())
    return dataclasses.replace(info, local=local, directory=directory)
