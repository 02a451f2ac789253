"""The node cache's records, each under one ``flock`` shared by every process of the node.

Shard files are hashed against ``index.json`` when first opened, once per file version per machine
(docs/safety.md): a bit flip that keeps token ids in range makes a valid, wrong row. A file that
passed is recorded under the foundrymix cache with its size, times, inode and device -- any write
changes ``ctime`` -- so later opens only ``stat`` it; a file that fails is never recorded.

``cache_limit``: the node's cache of one run's remote streams never holds more than the limit
(:class:`CacheBudget`).
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

from foundrymix.claims import FileLock, pid_alive
from foundrymix.errors import FoundrymixError, WorkerError
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


def node_lock(path: str) -> FileLock:
    """The node's lock on ``path`` (an ``flock``; its directory made): the one lock of the cache."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return FileLock(path)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` through ``<path>.part-<pid>``: no reader sees a partial file,
    and what a killed writer leaves is removed by the next run (``cache.clean_stale``)."""
    tmp = f'{path}.part-{os.getpid()}'
    try:
        with open(tmp, 'wb') as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


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
        lock = node_lock(path + '.lock')
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
    with contextlib.suppress(OSError):
        write_atomic(path, ''.join(json.dumps([base, *entry]) + '\n' for base, entry in kept.items()).encode('utf-8'))
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


class CacheFullError(FoundrymixError, ValueError):
    """No shard can be evicted and nothing in flight will free room: the limit is too small."""


class CacheBudget:
    """The shards of ``sources`` ((directory, index shards, window bytes) of each remote stream)
    kept under ``limit`` bytes in all with ``fixed`` bytes (index files, hash records) counted
    as held; ``lock`` names the account's lock file (the reservations beside it).

    The account is on disk: the shard files present, each live process's reservation for a fetch
    in flight, and the bound of the files kept beside them. A fetch reserves its bytes first,
    evicting shards of streams holding more than their shuffle window (least recently opened, file
    ``mtime``, first) until they fit, so each shard is fetched about once per pass (plan/window.py
    sizes the windows)."""

    def __init__(self, limit: int, sources: list[tuple[str, list[dict[str, Any]], int]], fixed: int,
                 lock: str) -> None:
        self.limit, self.fixed, self.lock = int(limit), int(fixed), lock
        self.files = [[os.path.join(d, f['basename']) for f in (s['raw_data'], s.get('zip_data')) if f]
                      for d, shards, _ in sources for s in shards]
        #: the stream of each shard, and each stream's window (what it may keep before its own are evicted)
        self.stream = [k for k, (_, shards, _) in enumerate(sources) for _ in shards]
        self.quota = [int(q) for _, _, q in sources]
        self._of = {f: k for files, k in zip(self.files, self.stream) for f in files}
        os.makedirs(os.path.dirname(lock), exist_ok=True)  # at start: an unwritable cache fails there

    def _reservations(self) -> dict[str, list[int]]:
        try:
            with open(self.lock + '.json', encoding='utf-8') as f:
                got = json.load(f)
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in got.items() if isinstance(v, list) and pid_alive(int(v[0]))}

    def _write(self, reservations: dict[str, list[int]]) -> None:
        write_atomic(self.lock + '.json', json.dumps(reservations).encode('utf-8'))

    def _present(self) -> list[tuple[float, int, list[str], int]]:
        """(oldest mtime, bytes, files, stream) of every shard with a file in the cache."""
        out = []
        for files, k in zip(self.files, self.stream):
            size, mtime, here = 0, None, []
            for path in files:
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                size += st.st_size
                mtime = st.st_mtime if mtime is None else min(mtime, st.st_mtime)
                here.append(path)
            if here:
                out.append((float(mtime or 0), size, here, k))
        return out

    def usage(self, held: dict[str, list[int]], present: Optional[list[tuple[float, int, list[str], int]]] = None
              ) -> int:
        """Bytes counted now: shards present, reservations, the fixed files and the account
        itself (twice: it is rewritten through a copy)."""
        shards = sum(p[1] for p in (self._present() if present is None else present))
        return shards + sum(v[1] for v in held.values()) + self.fixed + 2 * len(json.dumps(held))

    @contextlib.contextmanager
    def reserved(self, key: str, need: int, keep: Optional[str] = None) -> Iterator[None]:
        """Hold ``need`` bytes for the fetch of shard file ``key`` until the block ends, evicting
        first the least recently opened shard of a stream holding more than its window (the
        fetching one's included): a window in use is never evicted while an old one is cached."""
        while True:
            with node_lock(self.lock):
                held = self._reservations()
                held.pop(key, None)
                held[key] = [os.getpid(), int(need)]
                everything = self._present()
                usage = self.usage(held, everything)
                by = [0] * len(self.quota)  # each stream's bytes: its evictable shards and fetches
                for path, (_, size) in held.items():
                    if path in self._of:
                        by[self._of[path]] += size
                present = sorted(p for p in everything if keep not in p[2] and key not in p[2])
                for _, size, _, k in present:
                    by[k] += size
                while usage > self.limit and present:
                    over = [k for k in range(len(by)) if by[k] > self.quota[k]]
                    k = max(over, key=lambda k: by[k] - self.quota[k]) if over else None
                    _, size, files, k = present.pop(next(
                        (j for j, p in enumerate(present) if p[3] == k), 0))
                    for path in files:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                    usage -= size
                    by[k] -= size
                if usage <= self.limit:
                    self._write(held)
                    break
                if len(held) == 1:
                    raise CacheFullError(
                        f'cache_limit {self.limit:,} bytes: no room for {key} ({need:,} bytes) '
                        f'with nothing left to evict; raise cache_limit')
            time.sleep(0.01)  # only fetches in flight fill the cache: wait for one to end
        try:
            yield
        finally:
            with node_lock(self.lock):
                held = self._reservations()
                held.pop(key, None)
                self._write(held)
