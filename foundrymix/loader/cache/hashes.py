"""Shard files hashed against ``index.json`` when first opened, once per file version per machine
(docs/safety.md): a bit flip that keeps token ids in range makes a valid, wrong row. A file that
passed is recorded under the foundrymix cache with its size, times, inode and device -- any write
changes ``ctime`` -- so later opens only ``stat`` it; a file that fails is never recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import time
from typing import Any, Iterator, Optional

from foundrymix.claims import FileLock
from foundrymix.errors import WorkerError
from foundrymix.format.shards import hashes_in_index
from foundrymix.plan.window import RECORD_SLACK
from foundrymix.format.streaming_format import get_hash
from foundrymix.plan.config import cache_base

log = logging.getLogger(__name__)

RECORD_DIR = 'shard-hashes'
RECORD_TTL_DAYS = 30
SWEPT = '.swept'
#: cheapest first (xxh3 is what the converter records by default)
_FASTEST = ('xxh3_64', 'xxh3_128', 'xxh64', 'xxh128', 'xxh32', 'md5', 'sha1', 'sha256')


class CorruptLocalShardError(WorkerError):
    """A shard file of a stream without a remote does not match its ``index.json`` hash."""


def hash_algorithm(config: Any, index: dict[str, Any]) -> Optional[str]:
    """``validate_hash``, else (unless ``hash_local_shards: false``) the fastest algorithm recorded
    for every shard, else None (no check)."""
    if config.validate_hash:
        return config.validate_hash
    if not config.hash_local_shards:
        return None
    have = hashes_in_index(index)
    return next((algo for algo in _FASTEST if algo in have), min(have) if have else None)


def cache_file(cache_root: Optional[str], kind: str, directory: str, ext: str = '') -> str:
    """``<cache base>/<kind>/<key><ext>``, the key a hash of ``directory``'s real path."""
    key = hashlib.blake2s(os.path.realpath(directory).encode('utf-8'), digest_size=10).hexdigest()
    return os.path.join(cache_base(cache_root), kind, key + ext)


def record_path(cache_root: Optional[str], directory: str) -> str:
    """The record file of a stream directory."""
    return cache_file(cache_root, RECORD_DIR, directory, '.log')


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_hash(path: str, size: int, algorithm: str) -> str:
    """streaming's hash of a file, read through ``mmap`` (no copy of the file in memory)."""
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
        lock = FileLock(path + '.lock')
    except OSError as e:
        log.warning('cannot record verified shard hashes in %s (%s): every run hashes them',
                    os.path.dirname(path), e)
        yield False
        return
    with lock:
        yield True


def _read_lines(path: str) -> tuple[dict[str, list[Any]], int]:
    """basename -> its latest record line's entry, and the lines (one file per directory)."""
    out: dict[str, list[Any]] = {}
    lines = 0
    with contextlib.suppress(OSError), open(path, 'rb') as f:
        for line in f:
            lines += 1
            try:
                got = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash, or damaged
            if isinstance(got, list) and len(got) == 8 and isinstance(got[0], str):
                out[got[0]] = got[1:]
    return out, lines


def _compact(path: str, directory: str, entries: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Rewrite a record with one line per file still there unchanged (each fetch of an evicted
    shard adds one), atomically: it stays within the bound the cache budget counts
    (foundrymix.plan.window.record_bytes). Returns the entries kept."""
    kept = {}
    for base, entry in entries.items():
        with contextlib.suppress(OSError):
            if _identity(os.stat(os.path.join(directory, base))) == entry[2:]:
                kept[base] = entry
    tmp = f'{path}.part-{os.getpid()}'
    try:
        with open(tmp, 'w', encoding='utf-8') as f:
            for base, entry in kept.items():
                f.write(json.dumps([base, *entry]) + '\n')
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return kept


class ShardHashes:
    """What this process verified; :meth:`check` hashes a file once per version per machine."""

    def __init__(self, cache_root: Optional[str]) -> None:
        self.cache_root = cache_root
        self._seen: dict[tuple[str, str], list[Any]] = {}
        self._records: dict[str, dict[str, list[Any]]] = {}

    def check(self, directory: str, basename: str, expected: str, algo: str) -> bool:
        """Whether ``directory/basename`` matches its ``algo`` hash ``expected``; the record is
        compacted when it holds :data:`RECORD_SLACK` lines more than files."""
        path = os.path.join(directory, basename)
        st = os.stat(path)
        entry = [algo, expected, *_identity(st)]
        if self._seen.get((directory, basename)) == entry:
            return True
        record = record_path(self.cache_root, directory)
        if directory not in self._records:
            self._records[directory] = _read_lines(record)[0]
            with contextlib.suppress(OSError):
                os.utime(record)  # used now: kept by the sweep
        if self._records[directory].get(basename) != entry:
            with _locked(record) as recording:
                if recording:
                    self._records[directory], lines = _read_lines(record)
                    if lines > len(self._records[directory]) + RECORD_SLACK:
                        self._records[directory] = _compact(record, directory, self._records[directory])
                if self._records[directory].get(basename) != entry:
                    log.info('hashing %s (%s bytes, %s; once per file version)', path,
                             f'{st.st_size:,}', algo)
                    if file_hash(path, st.st_size, algo) != expected:
                        return False
                    self._records[directory][basename] = entry
                    if recording:
                        line = json.dumps([basename, *entry])
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
    with contextlib.suppress(FileNotFoundError):
        if now - os.stat(marker).st_mtime < 86400:
            return 0
    try:
        open(marker, 'a', encoding='utf-8').close()
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
