"""The node-local cache of remote streams: which run uses a directory, what a killed run
left behind, and whether the shards will fit -- all settled before the first batch.

Why this module exists. streaming (0.13) registers the local directory of every live
``StreamingDataset`` in machine-global shared memory (``/dev/shm/NNNNNN_locals``) and
refuses a second live dataset over the same directory *of a remote stream* with
``Reused local directory``. So:

* Two runs over one remote with the default cache (one directory per remote URL) died
  one time in two. **A run claims its cache directories** for as long as its dataset
  lives (:func:`claim`); a run that finds the default directory claimed by another live
  run uses the next free sibling (``<dir>-run2``, ``-run3``, ...). Why not a fresh
  directory per run: sequential runs -- the usual case, and every resumption -- then
  reuse the shards already downloaded; only runs that overlap in time download twice
  (the cost: one extra copy of what the overlapping run reads, on the same disk). A
  directory the user named (``local:`` with a ``remote:``) is never swapped: a second
  live run over it gets a :class:`ConfigError` naming the directory and the run that
  holds it.
* A run killed by SIGKILL (its process group, as a scheduler or the OOM killer does)
  never runs its ``atexit`` cleanup, so its shared memory stays and names its directory;
  killed before its first download, the next run over that directory got the same
  ``Reused local directory`` error until someone cleaned ``/dev/shm``. See
  :func:`clean_stale` for what is cleaned here and what streaming's own
  ``clean_stale_shared_memory`` covers.
* ``cache_limit`` below streaming's minimum, or a cache disk too small for what the run
  downloads, are refused with the stream, shard and directory named
  (:func:`check_space`) -- not found out mid-run.

How a claim works: each candidate directory is claimed ``EXCLUSIVE`` for the run with
:mod:`foundrymix.claims` (flock files in ``<tmp>/foundrymix-claims``, outside the cache,
so nothing is added to a directory the user named; released by the kernel when a process
dies, even by SIGKILL, so a claim can never go stale). While candidates are tried, the
configured directory's ``<h>.group`` lock is held, so two runs starting at once never
pick the same directory. The ranks of one job on a node share the run id
``MASTER_ADDR:MASTER_PORT`` and so the same directory, which streaming requires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from foundrymix import claims
from foundrymix.claims import Claim, pid_alive as _pid_alive
from foundrymix.config import ConfigError

log = logging.getLogger(__name__)

#: candidate directories tried for one default-cache directory before giving up
MAX_CANDIDATES = 64
_SHM_DIR = '/dev/shm'
_LOCALS_SHM = re.compile(r'^(\d{6})_locals$')
#: boto3/s3transfer writes ``<file>.<8 hex>`` and renames; other backends ``<file>.tmp``
_PARTIAL = re.compile(r'^(?P<base>.+)\.(?:[0-9A-Fa-f]{8}|tmp)$')
_PART_PID = re.compile(r'^(?P<base>.+)\.part-(?P<pid>\d+)$')


def candidate(home: str, k: int) -> str:
    """The ``k``-th directory a run may use for default-cache directory ``home`` (0: itself)."""
    return home if k == 0 else f'{home}-run{k + 1}'


@dataclass
class Claims:
    """Directories one dataset claimed; :meth:`release` when the dataset is done."""

    held: list[Claim] = field(default_factory=list)

    @property
    def dirs(self) -> list[str]:
        return [c.path for c in self.held]

    def release(self) -> None:
        while self.held:
            self.held.pop().release()


def claim(home: str, shared_default: bool, where: str) -> Claim:
    """Claim a directory for this run: ``home`` itself or, for the default cache
    (``shared_default``), its first sibling no other live run holds.

    Returns the claim of the directory (``path``); ``fresh`` when no live run held it
    before this one (then whatever a dead run left in it may be cleaned). A ``local:`` the
    user named and another live run holds raises :class:`ConfigError`.
    """
    configured, home = home, claims.normalize(home)
    paths = [candidate(home, k) for k in range(MAX_CANDIDATES if shared_default else 1)]
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
            f'{where}.local: {configured} is in use by another live run, {who}. streaming cannot '
            f'read one cache directory from two runs at once (it registers each live '
            f'dataset\'s directory machine-wide and refuses a second). Give this run its own '
            f'local: directory, or leave local: out to use the default cache, which gives '
            f'runs that overlap in time a directory each')
    raise ConfigError(f'{where}: all {MAX_CANDIDATES} cache directories for {configured} are in use '
                      f'by live runs (e.g. {who}); set cache_root to another directory')


@contextlib.contextmanager
def registering_prefix(limit: float = 300) -> Iterator[None]:
    """Hold the machine's shared-memory registration lock while a dataset is built.

    Why: streaming picks its shared-memory prefix by looking for the first free one and
    then creating it -- not atomic. Two runs building datasets at the same moment pick the
    same prefix and one dies with ``FileExistsError: '/NNNNNN_locals'`` (seen in the
    two-runs test once the ``Reused local directory`` error was gone). Only the local
    leader (``LOCAL_RANK`` 0) registers a prefix, so only it takes the lock: the other
    ranks of its job, which it waits for at streaming's barriers, never wait for it. The
    lock file lives in ``/dev/shm`` itself, the namespace the prefixes are unique in (two
    containers or test "nodes" with their own ``/dev/shm`` do not wait for each other).
    After ``limit`` seconds the dataset is built without it (never a deadlock).
    """
    if int(os.environ.get('LOCAL_RANK', '0') or 0) != 0 or not os.path.isdir(_SHM_DIR):
        yield
        return
    try:
        fd = os.open(os.path.join(_SHM_DIR, 'foundrymix-prefix.lock'), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + limit
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning('waited %.0f s for %s/foundrymix-prefix.lock; building the dataset '
                                'without it', limit, _SHM_DIR)
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


# ---------------------------------------------------------------------------- stale files
def _read_locals(name: str) -> list[str]:
    """Directories a streaming ``NNNNNN_locals`` segment registers (streaming's own packing)."""
    try:
        with open(os.path.join(_SHM_DIR, name), 'rb') as f:
            data = f.read()
        size = int.from_bytes(data[:4], 'little', signed=True)
        return data[4:size].decode('utf-8').split('\0')[:-1]
    except (OSError, ValueError, UnicodeDecodeError):
        return []


def _prefix_in_use(prefix: str) -> bool:
    """Whether any process maps or holds open one of streaming's segments ``<prefix>_*``.

    Python's ``SharedMemory`` creates segments with mode 0600, so only processes of the
    owner's uid (or root) use them, and a Python process of our own uid is dumpable, so
    its ``/proc/PID/maps`` and ``fd`` are readable to us. Processes whose entries we may
    not read are skipped: of another user, or non-dumpable (in this project's containers
    pid 1, the sandbox's agent, is such a process; counting it as a user meant never
    cleaning anything).
    """
    needle = f'{_SHM_DIR}/{prefix}_'
    me = str(os.getpid())
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or pid == me:
            continue
        try:
            with open(f'/proc/{pid}/maps', encoding='utf-8', errors='replace') as f:
                if needle in f.read():
                    return True
            for fd in os.listdir(f'/proc/{pid}/fd'):
                try:
                    if os.readlink(f'/proc/{pid}/fd/{fd}').startswith(needle):
                        return True
                except OSError:
                    continue
        except (FileNotFoundError, ProcessLookupError):  # the process ended meanwhile
            continue
        except PermissionError:  # not ours to read (see above)
            continue
    return False


def clean_stale(directory: str, stream_dirs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Remove what dead runs left that would stop or burden this run over ``directory``.

    Call only on a freshly claimed directory (no live foundrymix run holds it). Removed,
    each only when proven stale:

    * streaming's shared memory registering ``directory`` (``/dev/shm/NNNNNN_<name>`` for
      every name streaming creates) when no process maps or holds any segment of that
      prefix, and then the prefix's ``<tmp>/NNNNNN_barrier_filelock`` and
      ``NNNNNN_cache_filelock``. Why ourselves: streaming's
      ``streaming.base.util.clean_stale_shared_memory()`` unlinks *every* segment of
      prefixes 0, 1, ... until the first prefix with none, whether its owner is alive or
      not (it would pull the shared memory from under a live run on the same machine),
      and it leaves the ``/tmp`` filelocks; it is meant to be called once per machine
      before any run starts. A run killed after building its dataset but before its
      first download leaves the segments without filelocks: streaming then refuses the
      directory (``Reused local directory``) until someone cleans them. A run killed
      mid-epoch also leaves the filelocks, which make streaming skip the dead prefix: no
      error, but the segments and files leak for good.
    * partial downloads in each stream directory: ``<shard>.<8 hex>`` (boto3's temporary
      name), ``<file>.tmp`` (streaming's other backends, decompression, ``index.json``)
      for files the index names; ``<file>.part-PID`` (our metadata fetch) whose PID is
      dead. They are never read (streaming counts only final names) but fill the disk.

    ``stream_dirs`` is (directory with split, index) per stream. Returns what was removed.
    """
    removed: list[str] = []
    target = os.path.normpath(directory)
    live_registration = False
    for name in sorted(os.listdir(_SHM_DIR)) if os.path.isdir(_SHM_DIR) else []:
        m = _LOCALS_SHM.match(name)
        if not m:
            continue
        dirs = [os.path.normpath(d) for d in _read_locals(name)]
        if not any(d == target or d.startswith(target + os.sep) for d in dirs):
            continue
        prefix = m.group(1)
        if _prefix_in_use(prefix):
            live_registration = True
            continue
        removed += _remove_prefix(prefix)
    for stream_dir, index in stream_dirs:
        names = {'index.json', 'foundrymix.json'}
        for shard in index.get('shards', []):
            for key in ('raw_data', 'zip_data'):
                if shard.get(key):
                    names.add(shard[key]['basename'])
        try:
            listing = os.listdir(stream_dir)
        except FileNotFoundError:
            continue
        for entry in listing:
            path = os.path.join(stream_dir, entry)
            part, partial = _PART_PID.match(entry), _PARTIAL.match(entry)
            if part:  # our metadata fetch: stale once its process is gone
                stale = part.group('base') in names and not _pid_alive(int(part.group('pid')))
            else:  # a download: stale unless a (non-foundrymix) reader is live here
                stale = bool(partial) and partial.group('base') in names and not live_registration
            if not stale:
                continue
            try:
                if os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)
                    removed.append(path)
            except FileNotFoundError:
                pass
    if removed:
        log.warning('cache %s: removed what dead runs left: %s', directory, ', '.join(removed))
    return removed


def _remove_prefix(prefix: str) -> list[str]:
    """Unlink a dead prefix's segments while a filelock keeps new datasets off the prefix.

    streaming skips a prefix while ``<tmp>/<prefix>_cache_filelock`` exists, so no new
    dataset can register the prefix between our unlinks (and have its fresh segments
    unlinked); the filelocks go last.
    """
    from foundrymix.loader.streaming_compat import filelock_names, shm_names_to_clean
    BARRIER_FILELOCK, CACHE_FILELOCK = filelock_names()
    SHM_TO_CLEAN = shm_names_to_clean()
    removed = []
    locks = [os.path.join(tempfile.gettempdir(), f'{prefix}_{n}') for n in (BARRIER_FILELOCK, CACHE_FILELOCK)]
    open(locks[1], 'a').close()
    for name in SHM_TO_CLEAN:
        path = os.path.join(_SHM_DIR, f'{prefix}_{name}')
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    for path in locks:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


# ---------------------------------------------------------------------------- space
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
            path = os.path.join(directory, entry)
            try:
                if os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)
                    removed.append(path)
            except FileNotFoundError:
                pass
    return removed


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
                if _file_hash(path, size, validate_hash) == expected:
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


def _file_hash(path: str, size: int, algorithm: str) -> str:
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


# ---------------------------------------------------------------------------- all of it
def prepare(config: Any, infos: list[Any], where: str) -> tuple[list[Any], Claims]:
    """Claim the cache directory of every remote stream, clean what dead runs left there,
    remove cached shards that do not match ``index.json`` (:func:`check_cached`; in the
    node's first process only, as streaming's local leader alone sets up the cache and
    the others wait for it), and check the space: the infos to build streams from (``local`` may now be a sibling
    of the configured directory) and the claims to release with the dataset."""
    held = Claims()
    out = []
    try:
        for info in infos:
            if not info.remote_dir:
                out.append(info)
                continue
            shared_default = not info.spec.local
            got = claim(info.local, shared_default, f'{where}.streams.{info.name}')
            held.held.append(got)
            local = got.path if os.path.normpath(got.path) != os.path.normpath(claims.normalize(info.local)) \
                else info.local
            if local != info.local:
                info = _moved(info, local)
            if got.fresh:
                clean_stale(local, [(info.directory, info.index)])
            if int(os.environ.get('LOCAL_RANK', '0') or 0) == 0:  # streaming's local leader
                check_cached(info.name, info.directory, info.index, config.validate_hash)
            out.append(info)
        check_space(config, out, where)
    except BaseException:
        held.release()
        raise
    return out, held


def _moved(info: Any, local: str) -> Any:
    """``info`` read from another directory: its metadata copied there (index and manifest).

    A sibling directory left by an earlier run may hold another version of the stream:
    its shard files named by its old index are removed first (the directory is ours, the
    default cache, claimed by this run).
    """
    split = info.spec.split
    directory = os.path.join(local, split) if split else local
    os.makedirs(directory, exist_ok=True)
    for name in ('foundrymix.json', 'index.json'):
        src, dst = os.path.join(info.directory, name), os.path.join(directory, name)
        with open(src, 'rb') as f:
            data = f.read()
        try:
            with open(dst, 'rb') as f:
                same = f.read() == data
        except FileNotFoundError:
            same = None
        if same is False and name == 'index.json':
            old = json.loads(open(dst, encoding='utf-8').read())
            for shard in old.get('shards', []):
                for key in ('raw_data', 'zip_data'):
                    if shard.get(key):
                        try:
                            os.remove(os.path.join(directory, shard[key]['basename']))
                        except FileNotFoundError:
                            pass
        if not same:
            tmp = f'{dst}.part-{os.getpid()}'
            with open(tmp, 'wb') as f:
                f.write(data)
            os.replace(tmp, dst)
    return dataclasses.replace(info, local=local, directory=directory)
