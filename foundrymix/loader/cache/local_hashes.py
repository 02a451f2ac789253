"""Local shards hashed against ``index.json`` once per file version, before their first row.

Part of :mod:`foundrymix.loader.cache` (see its docstring for why it is a package).

Why: streaming (0.13) checks ``validate_hash`` only when it downloads or decompresses a
shard; the shard files of a stream without a remote are read as they are. A flipped bit
that keeps every token id below the vocabulary size makes a valid row -- just the wrong
one -- so the row checks cannot see it, and a run on a damaged copy trained on it and
exited 0, ``validate_hash: xxh3_64`` set or not. Here every shard file of a local stream
that ``index.json`` records a hash for is hashed (:func:`~foundrymix.loader.cache.space.
file_hash`, the one hasher of the cache checks) when the run starts, by default.

Why by default, and why once per file version: the converter records ``xxh3_64`` for
every shard, and hashing is one read of the data: 5 x 64 MB shards hashed in 0.24 s from
disk (page cache evicted) and 0.15 s from the page cache, against 0.47 s for one ``read()``
of the files and 21-23 s for one pass of streaming's reader over their rows (medians of 3,
``benchmarks/bench_hash.py``, shared 2-core VM at load ~15). A file that passed is
recorded under the foundrymix cache directory (``<cache_root or $FOUNDRYMIX_CACHE or
<tmp>/foundrymix-cache>/shard-hashes/``, never in the user's dataset directory) with its
size, ``mtime_ns``, ``ctime_ns``, inode and device: the next run only ``stat`` s it. Any
write to the file, a copy over it, or a rename onto it changes ``ctime`` (no tool can set
it back), so a changed file is hashed again. What a record cannot see: bits that change
on the disk without a write (media decay); ``foundrymix verify DIR`` reads everything.

With many processes per node, each takes the directory's lock in turn: the first hashes
and records, the others find the records and only ``stat``. A file that fails is never
recorded, so every process hashes it and every one refuses -- no rank goes on alone.
The ranks of a node hash different directories at once (:func:`check_local_streams`):
each starts at its own share and passes over a directory whose lock another holds,
coming back to it last. Before, they all queued on the first directory's lock and one
hashed everything: two ranks over 8 directories (538 MB) took 78-80 ms from the page
cache and 356-383 ms from disk, now 52 ms and 282 ms (``benchmarks/bench_hash.py
--ranks 2``, 2-core VM whose disk serves one reader as fast as two; a node's 8 ranks on
a disk that serves parallel reads may gain more, not measured).

A run's start reads one more record first: that of its whole set of stream directories
(:func:`check_local_streams`), so a run over 1,000 streams that were all verified before
reads one file and ``stat`` s the shards, instead of taking 1,000 locks and reading 1,000
records (issue 22).

Records do not pile up (:func:`sweep_records`): one not written or used for
:data:`RECORD_TTL_DAYS` days is removed, at most once a day, by a start that wrote a record.
Before, nothing was ever removed: this machine's shared cache held 63,633 files (130 MB)
after a few days of tests and benchmarks, one record and one lock per stream directory
ever checked, most of them long deleted. A directory used again after its record expired
is hashed once more -- a read of its data, never a wrong answer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from foundrymix.errors import FoundrymixError
from foundrymix.format.shards import INDEX_NAME, hashes_in_index

log = logging.getLogger(__name__)

#: the folder of the records under the cache directory
RECORD_DIR = 'shard-hashes'
#: a record neither written nor used (its mtime) for this many days is removed
RECORD_TTL_DAYS = 30
#: the file whose mtime says when the records were last swept (at most once a day)
SWEPT = '.swept'
#: cheapest first (streaming's algorithms; xxh3 is what the converter records by default)
_FASTEST = ('xxh3_64', 'xxh3_128', 'xxh64', 'xxh128', 'xxh32', 'md5', 'sha1', 'sha256')


class CorruptLocalShardError(FoundrymixError, ValueError):
    """A shard file of a stream without a remote does not match its ``index.json`` hash."""


@dataclass
class LocalHashCheck:
    """What :func:`check_local_shards` did for one stream directory."""

    algorithm: Optional[str] = None  #: ``None``: nothing to check (off, or no hashes recorded)
    hashed_files: list[str] = field(default_factory=list)  #: basenames hashed this time
    hashed_bytes: int = 0
    recorded_files: int = 0  #: files that passed earlier (only ``stat`` ed)
    seconds: float = 0.0


def local_hash_algorithm(config: Any, index: dict[str, Any]) -> Optional[str]:
    """The algorithm a local stream's shards are hashed with, or ``None`` for no check.

    ``validate_hash`` if set (the catalog checked every shard records it), else the
    fastest algorithm recorded for every shard; ``hash_local_shards: false`` turns it off.
    """
    if not config.hash_local_shards:
        return None
    if config.validate_hash:
        return config.validate_hash
    have = hashes_in_index(index)
    for algo in _FASTEST:
        if algo in have:
            return algo
    return min(have) if have else None


def record_path(cache_root: Optional[str], directory: str) -> str:
    """The record file of a stream directory (named by a hash of its real path)."""
    from foundrymix.plan.config import cache_base
    real = os.path.realpath(directory)
    key = hashlib.blake2s(real.encode('utf-8'), digest_size=10).hexdigest()
    return os.path.join(cache_base(cache_root), RECORD_DIR, f'{key}.json')


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


@contextlib.contextmanager
def _locked(path: str, wait: bool = True) -> Iterator[Optional[bool]]:
    """Hold the record's lock; yields False (hash, record nothing) if the cache directory
    cannot be written: a read-only cache costs a re-hash next run, never the run. With
    ``wait=False``, yields None at once, holding nothing, while another process holds it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + '.lock', os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        log.warning('cannot record verified shard hashes in %s (%s): every run hashes them',
                    os.path.dirname(path), e)
        yield False
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            try:  # a sweep may have removed the file between our open and our lock
                if os.stat(path + '.lock').st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
            fd = os.open(path + '.lock', os.O_RDWR | os.O_CREAT, 0o666)
        yield True
    finally:
        os.close(fd)


def _touch(path: str) -> None:
    """Mark a record used now (its mtime), so :func:`sweep_records` keeps it."""
    with contextlib.suppress(OSError):  # a read-only cache: the record may expire, costing a re-hash
        os.utime(path)


def sweep_records(folder: str, now: Optional[float] = None) -> int:
    """Remove the records under ``folder`` not written or used for :data:`RECORD_TTL_DAYS`
    days, with their locks; at most once a day (the :data:`SWEPT` file's mtime). Returns
    how many records it removed.

    Only ``stat`` s: it does not read the records. Measured 0.5-0.6 s for 63,633 files (a
    cache nobody had swept, 2-core VM at load 3); a swept cache holds a few files per
    stream directory in use, and a start that sweeps has just hashed something. A lock
    file goes only while no process holds it (``LOCK_NB``), and a locker that finds its
    lock file replaced locks the new one (:func:`_locked`), so two processes never both
    think they hold a directory's lock.
    """
    now = time.time() if now is None else now
    marker = os.path.join(folder, SWEPT)
    try:
        if now - os.stat(marker).st_mtime < 86400:
            return 0
    except FileNotFoundError:
        pass
    try:
        with open(marker, 'a', encoding='utf-8'):
            pass
        os.utime(marker, (now, now))
        entries = list(os.scandir(folder))
    except OSError:  # a read-only cache is left as it is
        return 0
    cutoff = now - RECORD_TTL_DAYS * 86400
    removed = 0
    for entry in entries:
        with contextlib.suppress(OSError):
            if '.json.part-' in entry.name and entry.stat().st_mtime < cutoff:
                os.remove(entry.path)  # a writer killed between its write and its rename
                continue
            if not entry.name.endswith('.json') or entry.stat().st_mtime >= cutoff:
                continue
            lock = entry.path + '.lock'
            if not os.path.exists(lock):
                os.remove(entry.path)
                removed += 1
                continue
            fd = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: in use, keep it
                if entry.stat().st_mtime < cutoff:  # not rewritten while we waited
                    os.remove(entry.path)
                    os.remove(lock)
                    removed += 1
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
    if removed:
        log.info('removed %d shard-hash record(s) unused for %d days from %s', removed,
                 RECORD_TTL_DAYS, folder)
    return removed


def _read_records(path: str, directory: str) -> dict[str, Any]:
    try:
        with open(path, encoding='utf-8') as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get('directory') != os.path.realpath(directory):
        return {}
    files = data.get('files')
    return files if isinstance(files, dict) else {}


def _replace_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` whole or not at all (``os.replace``: a reader without the
    lock sees the old file or the new one). Raises OSError (a read-only cache)."""
    tmp = f'{path}.part-{os.getpid()}'
    try:
        with open(tmp, 'w', encoding='utf-8') as f:
            json.dump(data, f, separators=(',', ':'))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write_records(path: str, directory: str, files: dict[str, Any]) -> None:
    try:
        _replace_json(path, {'directory': os.path.realpath(directory), 'files': files})
    except OSError as e:  # a read-only cache costs a re-hash next run, never the run
        log.warning('could not record verified shard hashes in %s: %s', path, e)


#: (directory, basename) -> record entry of the files this process verified or found
#: recorded: a run checks every stage's streams at its start and again as it builds each
#: stage's dataset; the second check only ``stat`` s (2,000 lock+read+parse of records
#: cost 4.4 s of a 1,000-stream start, issue 22). A changed file has a new identity.
_SEEN: dict[tuple[str, str], list[Any]] = {}


def _hashed_files(directory: str, index: dict[str, Any], algo: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """(basename, expected hash, stat) of every shard file of ``directory`` whose ``index.json``
    records an ``algo`` hash and that exists (a compressed stream has no raw file until
    streaming unpacks it; the catalog's size check refuses a missing shard)."""
    for shard in index['shards']:
        for key in ('raw_data', 'zip_data'):
            info = shard.get(key)
            expected = ((info or {}).get('hashes') or {}).get(algo)
            if expected is None:
                continue
            try:
                st = os.stat(os.path.join(directory, info['basename']))
            except FileNotFoundError:
                continue
            yield info['basename'], expected, st


def _all_seen(directory: str, index: dict[str, Any], algo: str) -> Optional[int]:
    """How many files, if every hashed shard file of ``directory`` is one this process found
    verified and recorded, unchanged (its stat identity as then); None if any is new,
    changed or not seen (then the record is read, under its lock)."""
    seen = 0
    for base, expected, st in _hashed_files(directory, index, algo):
        if _SEEN.get((directory, base)) != [algo, expected, *_identity(st)]:
            return None
        seen += 1
    return seen


def check_local_shards(name: str, directory: str, index: dict[str, Any], config: Any,
                       wait: bool = True) -> Optional[LocalHashCheck]:
    """Hash the shard files of stream ``name`` (no remote) not verified in this version yet.

    Raises :class:`CorruptLocalShardError` naming the stream, its directory and every
    file that does not match, before any row is read. Files absent are skipped (the
    catalog's size check refuses a missing shard; a compressed stream has no raw file
    until streaming unpacks it). With ``wait=False``, returns None, having done nothing,
    while another process holds the directory's lock (it is hashing it now).
    """
    from foundrymix.loader.cache.space import file_hash
    result = LocalHashCheck(algorithm=local_hash_algorithm(config, index))
    algo = result.algorithm
    if algo is None:
        return result
    start = time.monotonic()
    seen = _all_seen(directory, index, algo)
    if seen is not None:
        result.recorded_files = seen
        result.seconds = time.monotonic() - start
        return result
    record = record_path(config.cache_root, directory)
    bad: list[str] = []
    with _locked(record, wait) as recording:
        if recording is None:
            return None
        files = _read_records(record, directory) if recording else {}
        pending = []
        for base, expected, st in _hashed_files(directory, index, algo):
            entry = [algo, expected, *_identity(st)]
            if files.get(base) == entry:
                result.recorded_files += 1
                continue
            files.pop(base, None)
            pending.append((base, st.st_size, entry))
            result.hashed_files.append(base)
            result.hashed_bytes += st.st_size
        if pending:  # said first: a first run over a large stream reads it all (minutes)
            log.info("stream '%s': hashing %d local shard file(s), %s bytes (%s; once per "
                     'file version; hash_local_shards: false skips it)', name, len(pending),
                     f'{result.hashed_bytes:,}', algo)
        for base, size, entry in pending:
            if file_hash(os.path.join(directory, base), size, algo) == entry[1]:
                files[base] = entry
            else:
                bad.append(base)
        if result.hashed_files and recording:
            _write_records(record, directory, files)
        elif recording and result.recorded_files:
            _touch(record)
        if recording:  # a file not recorded (a read-only cache) is hashed again next time
            _SEEN.update(((directory, b), e) for b, e in files.items())
    result.seconds = time.monotonic() - start
    if result.hashed_files:
        log.info("stream '%s': hashed %d local shard file(s), %s bytes (%s) in %.2f s", name,
                 len(result.hashed_files), f'{result.hashed_bytes:,}', algo, result.seconds)
    if bad:
        listing = ', '.join(bad[:10]) + (f' and {len(bad) - 10} more' if len(bad) > 10 else '')
        raise CorruptLocalShardError(
            f"stream '{name}' ({directory}): shard file(s) {listing} do not match the {algo} "
            f'hash its {INDEX_NAME} records: the bytes changed after conversion (a damaged '
            f'copy or disk); no row of it was read. Re-copy the stream from where it came '
            f'from, or re-run `foundrymix convert` into {directory} with --overwrite; '
            f'`foundrymix verify {directory}` checks every shard')
    return result


def set_record_path(cache_root: Optional[str], directories: list[str]) -> str:
    """The one record file of a set of stream directories (named by a hash of the sorted set)."""
    from foundrymix.plan.config import cache_base
    key = hashlib.blake2s(json.dumps(sorted(directories)).encode('utf-8'), digest_size=10).hexdigest()
    return os.path.join(cache_base(cache_root), RECORD_DIR, f'set-{key}.json')


def _read_set(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding='utf-8') as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _from_set(info: Any, files: Any, config: Any) -> Optional[LocalHashCheck]:
    """The check of one stream directory when the set's record has every hashed file of it,
    unchanged (each file's stat identity as recorded); None if any is new or changed."""
    result = LocalHashCheck(algorithm=local_hash_algorithm(config, info.index))
    algo = result.algorithm
    if algo is None:
        return result
    if not isinstance(files, dict):
        return None
    found = []
    for base, expected, st in _hashed_files(info.directory, info.index, algo):
        entry = [algo, expected, *_identity(st)]
        if files.get(base) != entry:
            return None
        found.append(((info.directory, base), entry))
    _SEEN.update(found)
    result.recorded_files = len(found)
    return result


def check_local_streams(config: Any, infos: list[Any]) -> list[LocalHashCheck]:
    """:func:`check_local_shards` for every stream without a remote -- first against one
    record of the whole set of directories.

    Why one record: the per-directory records cost a lock, two ``realpath`` s and a file
    read per directory -- 0.17 s of a 1,000-stream start, 0.3 of foundrymix's 0.55 s over
    raw streaming (issue 22). The set's record (``shard-hashes/set-<hash>.json``, written
    with ``os.replace`` after every directory passed, read without a lock: a reader sees a
    whole old or a whole new file) holds the same entries -- algorithm, expected hash, size,
    ``mtime_ns``, ``ctime_ns``, inode, device -- so a directory whose files all match it is
    as verified as by its own record, after one ``stat`` per file. Any other directory
    (a new file, a changed one, a first run) goes through :func:`check_local_shards`: its
    lock, its record, the hash; two ranks still hash once.
    """
    local = [i for i in infos if not i.remote_dir]
    if not local:
        return []
    path = set_record_path(config.cache_root, [i.directory for i in local])
    known = _read_set(path)
    out: list[Optional[LocalHashCheck]] = [_from_set(i, known.get(i.directory), config) for i in local]
    todo = [k for k, result in enumerate(out) if result is None]
    missed = bool(todo)
    # The ranks of a node each start at their own share of the directories and pass over
    # one another's (the lock is held: that rank is hashing it), so they hash in parallel;
    # then each waits for what it passed over and only reads its record (issue 22).
    deferred = []
    for k in _own_share_first(todo):
        result = check_local_shards(local[k].name, local[k].directory, local[k].index, config,
                                    wait=False)
        if result is None:
            deferred.append(k)
        out[k] = result
    for k in deferred:
        out[k] = check_local_shards(local[k].name, local[k].directory, local[k].index, config)
    if not missed:
        _touch(path)
    else:  # every directory passed (a failure raised): record the set for the next run
        dirs = {i.directory for i in local}
        files: dict[str, dict[str, Any]] = {d: {} for d in dirs}
        for (d, base), entry in _SEEN.items():
            if d in dirs:
                files[d][base] = entry
        with contextlib.suppress(OSError):  # a read-only cache: per directory next run, as now
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _replace_json(path, files)
        sweep_records(os.path.dirname(path))
    return out  # type: ignore[return-value]  (every entry is set above)


def _own_share_first(items: list[int]) -> list[int]:
    """``items`` rotated to start at this process's share: local rank ``r`` of ``w``
    (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, as Composer's launcher and torchrun set them)
    starts at item ``r * len / w``."""
    try:
        rank = int(os.environ.get('LOCAL_RANK') or 0)
        world = int(os.environ.get('LOCAL_WORLD_SIZE') or 1)
    except ValueError:
        rank, world = 0, 1
    if world <= 1 or not 0 <= rank < world:
        return list(items)
    start = rank * len(items) // world
    return items[start:] + items[:start]
