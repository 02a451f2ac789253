"""What a killed run left in a cache directory and in ``/dev/shm``: found and cleaned
before the next run over that directory starts.

Part of :mod:`foundrymix.loader.cache` (see its docstring for why).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from typing import Any

from foundrymix.claims import pid_alive as _pid_alive
from foundrymix.loader.cache.space import remove_plain_file

log = logging.getLogger(__name__)

_SHM_DIR = '/dev/shm'
_LOCALS_SHM = re.compile(r'^(\d{6})_locals$')
#: boto3/s3transfer writes ``<file>.<8 hex>`` and renames; other backends ``<file>.tmp``
_PARTIAL = re.compile(r'^(?P<base>.+)\.(?:[0-9A-Fa-f]{8}|tmp)$')
_PART_PID = re.compile(r'^(?P<base>.+)\.part-(?P<pid>\d+)$')


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
            remove_plain_file(path, removed)
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
