"""Shard files hashed against ``index.json`` when first opened, once per file version.

Part of :mod:`foundrymix.loader.cache`. Why: a flipped bit that keeps every token id below
the vocabulary size makes a valid row -- just the wrong one -- so no row check can see it.
So before a process reads the first row of a shard file (a local stream's, or a cached copy
of a remote one) the file is hashed with the algorithm ``index.json`` records (the
converter records ``xxh3_64``; ``validate_hash`` picks another; ``hash_local_shards:
false`` turns it off). Only the shards a run reads are hashed, as it reads them: a start
reads no data.

Once per file version: a file that passed is recorded under the foundrymix cache
(``<cache_base>/shard-hashes/<directory key>.log``, never in the user's directory) with its
size, ``mtime_ns``, ``ctime_ns``, inode and device; later opens, in any process of the
machine, only ``stat`` it. Any write to the file, a copy over it or a rename onto it
changes ``ctime``, so a changed file is hashed again. A record is one appended line, so
records of one directory never need rewriting. What a record cannot see: bits that change
on the disk without a write (media decay); ``foundrymix verify DIR`` reads everything.

Processes hashing the same directory take its lock in turn, so a file is hashed once and
the others find its record. A file that fails is never recorded: every process that opens
it hashes it and refuses it. Records not used for :data:`RECORD_TTL_DAYS` days are swept.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from typing import Any, Iterator, Optional

from foundrymix.errors import WorkerError
from foundrymix.format.shards import hashes_in_index

log = logging.getLogger(__name__)

RECORD_DIR = 'shard-hashes'
RECORD_TTL_DAYS = 30
SWEPT = '.swept'
#: cheapest first (xxh3 is what the converter records by default)
_FASTEST = ('xxh3_64', 'xxh3_128', 'xxh64', 'xxh128', 'xxh32', 'md5', 'sha1', 'sha256')


class CorruptLocalShardError(WorkerError):
    """A shard file of a stream without a remote does not match its ``index.json`` hash."""


def hash_algorithm(config: Any, index: dict[str, Any]) -> Optional[str]:
    """The algorithm a stream's shards are hashed with, or ``None`` for no check:
    ``validate_hash`` if set, else (unless ``hash_local_shards: false``) the fastest
    algorithm recorded for every shard."""
    if config.validate_hash:
        return config.validate_hash
    if not config.hash_local_shards:
        return None
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
    return os.path.join(cache_base(cache_root), RECORD_DIR, f'{key}.log')


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_hash(path: str, size: int, algorithm: str) -> str:
    """streaming's hash of a file, read through ``mmap`` (no copy of the file in memory)."""
    import mmap

    from foundrymix.format.streaming_format import get_hash
    if size == 0:
        return get_hash(algorithm, b'')
    with open(path, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return get_hash(algorithm, data)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[bool]:
    """Hold the record's lock; yields False (hash, record nothing) if the cache cannot be
    written: a read-only cache costs a re-hash next time, never the run."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + '.lock', os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        log.warning('cannot record verified shard hashes in %s (%s): every run hashes them',
                    os.path.dirname(path), e)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def _read(path: str, directory: str) -> dict[str, list[Any]]:
    """basename -> its latest record line's entry (lines of other directories ignored)."""
    return _read_lines(path, directory)[0]


def _read_lines(path: str, directory: str) -> tuple[dict[str, list[Any]], int]:
    """:func:`_read`, and how many lines the record has."""
    out: dict[str, list[Any]] = {}
    lines = 0
    real = os.path.realpath(directory)
    try:
        with open(path, 'rb') as f:
            for line in f:
                lines += 1
                try:
                    got = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash, or damaged
                if isinstance(got, list) and len(got) == 9 and got[0] == real:
                    out[got[1]] = got[2:]
    except OSError:
        pass
    return out, lines


def _compact(path: str, directory: str, entries: dict[str, list[Any]]) -> None:
    """Rewrite a record with one line per file (a cache whose shards are evicted and fetched
    again adds a line per fetch); whole or not at all."""
    real = os.path.realpath(directory)
    tmp = f'{path}.part-{os.getpid()}'
    try:
        with open(tmp, 'w', encoding='utf-8') as f:
            for base, entry in entries.items():
                f.write(json.dumps([real, base, *entry]) + '\n')
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


class ShardHashes:
    """What this process verified; :meth:`check` hashes a file once per version per machine."""

    def __init__(self, cache_root: Optional[str]) -> None:
        self.cache_root = cache_root
        self._seen: dict[tuple[str, str], list[Any]] = {}
        self._records: dict[str, dict[str, list[Any]]] = {}
        #: basenames this process hashed (the others it found recorded)
        self.hashed: list[str] = []

    def check(self, directory: str, basename: str, expected: str, algo: str,
              fresh: bool = False) -> bool:
        """Whether ``directory/basename`` matches ``expected`` (its ``algo`` hash); ``fresh``:
        this process just wrote the file (no other can have recorded it: hash it at once)."""
        path = os.path.join(directory, basename)
        st = os.stat(path)
        entry = [algo, expected, *_identity(st)]
        if self._seen.get((directory, basename)) == entry:
            return True
        record = record_path(self.cache_root, directory)
        if directory not in self._records:
            self._records[directory] = _read(record, directory)
            with contextlib.suppress(OSError):
                os.utime(record)  # used now: kept by the sweep
        if self._records[directory].get(basename) != entry:
            with _locked(record) as recording:
                if recording and not fresh:
                    self._records[directory], lines = _read_lines(record, directory)
                    if lines > 2 * len(self._records[directory]) + 64:
                        _compact(record, directory, self._records[directory])
                if self._records[directory].get(basename) != entry:
                    log.info('hashing %s (%s bytes, %s; once per file version)', path,
                             f'{st.st_size:,}', algo)
                    if file_hash(path, st.st_size, algo) != expected:
                        return False
                    self.hashed.append(basename)
                    self._records[directory][basename] = entry
                    if recording:
                        line = json.dumps([os.path.realpath(directory), basename, *entry])
                        try:
                            with open(record, 'a', encoding='utf-8') as f:
                                f.write(line + '\n')
                        except OSError as e:
                            log.warning('could not record a verified shard hash in %s: %s', record, e)
                        sweep_records(os.path.dirname(record))
        self._seen[(directory, basename)] = entry
        return True


def sweep_records(folder: str, now: Optional[float] = None) -> int:
    """Remove the records under ``folder`` not written or used for :data:`RECORD_TTL_DAYS`
    days (at most once a day: the :data:`SWEPT` file's mtime). Returns how many."""
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
    except OSError:
        return 0
    cutoff = now - RECORD_TTL_DAYS * 86400
    removed = 0
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.name.endswith(('.log', '.json')) and entry.stat().st_mtime < cutoff:
                os.remove(entry.path)
                removed += 1
    if removed:
        log.info('removed %d shard-hash record(s) unused for %d days from %s', removed,
                 RECORD_TTL_DAYS, folder)
    return removed
