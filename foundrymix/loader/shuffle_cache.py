"""streaming's epoch shuffle, recorded once per set of arguments and re-read on a restart.

Why (issue 22): the largest single step of a start over many streams is streaming's
shuffle of the epoch's samples (``streaming.base.shuffle.get_shuffle``, called by
``generate_work`` when the loader's first batch is asked for): 0.11 s of a ~0.41 s raw
``StreamingDataset`` start over 1,000 streams (1.4M samples; py1e), 1.29 s at 10,000
(14M), measured alone on this 2-core machine. A resumed or restarted run shuffles the
same epoch again; this reads it back instead (3 ms and 21 ms for those two, ``np.load``).

Why it is exact: ``get_shuffle(algo, shard_sizes, num_canonical_nodes, seed, epoch,
block_size)`` is a pure function of its arguments (a numpy ``default_rng`` seeded from
``seed`` and ``epoch``, no other state). The record's key is every argument (the sizes
array by dtype and bytes), the versions of Python, numpy and streaming, and the source of
streaming's shuffle package -- a record of other arguments or other code is a miss, never
a false hit. Everything else in ``generate_work`` (resampling the streams, the partition
over nodes, ranks and workers, the resume point) is computed as before, so a resume at
any batch, on any topology, reads the same epoch record.

Same switch as the plan records (:data:`foundrymix.plan.plan_cache.MODE_ENV`): ``off``
shuffles afresh and records nothing; ``verify`` also shuffles afresh on a hit and stops
the start if the two differ in any element (the test suite runs with it). Same safety: a
record is read only from a folder and file owned by this user and writable by no one else
(``np.load`` without pickles), and one whose length is not the number of samples
(a truncated file) is shuffled afresh. Records live in ``<cache>/shuffles/``; one over
:data:`MAX_RECORD_BYTES` is not written (the shuffle is recomputed each start), and the
least recently used are removed once the folder holds more than :data:`KEEP_BYTES`.
streaming's own warning from the shuffle (``Shuffle block size was smaller than shard
size``) is given when the shuffle is computed -- the first start -- not when it is read.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
from typing import Any, Callable, Optional

import numpy as np

from foundrymix.errors import FoundrymixError
from foundrymix.plan.config import cache_base
from foundrymix.plan.plan_cache import is_private, record_mode, write_private

logger = logging.getLogger(__name__)

#: the folder of the records under the cache directory
RECORD_DIR = 'shuffles'
#: a shuffle larger than this is not recorded (16M samples, int64)
MAX_RECORD_BYTES = 128 << 20
#: the folder is pruned to this, least recently used first
KEEP_BYTES = 1 << 30
#: bump when the record's layout changes
_FORMAT = 1
_code_digest: Optional[str] = None


class ShuffleRecordMismatch(FoundrymixError, RuntimeError):
    """A recorded shuffle differs from a fresh one of the same arguments (``verify`` mode)."""


class ShuffleRecords:
    """The shuffle records of one cache directory; :meth:`shuffle` stands in for streaming's
    ``get_shuffle`` (``loader/streaming_compat.py:recorded_shuffles`` puts it there)."""

    def __init__(self, cache_root: Optional[str] = None) -> None:
        self.folder = os.path.join(cache_base(cache_root), RECORD_DIR)

    def shuffle(self, compute: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``compute(*args, **kwargs)`` (streaming's ``get_shuffle``), read from its record
        when there is one."""
        mode = record_mode()
        if mode == 'off':
            return compute(*args, **kwargs)
        try:
            bound = inspect.signature(compute).bind(*args, **kwargs)
            bound.apply_defaults()
            key = _key(bound.arguments)
            samples = int(np.sum(bound.arguments['shard_sizes']))
        except Exception:  # arguments of a shape this version does not know: no record
            return compute(*args, **kwargs)
        path = os.path.join(self.folder, key + '.npy')
        recorded = _read(path, self.folder)
        if recorded is not None and recorded.shape != (samples,):  # a shuffle orders every sample
            logger.warning('shuffle: ignoring the record %s (%d entries for %d samples)', path,
                           recorded.size, samples)
            recorded = None
        if recorded is not None:
            if mode == 'verify':
                fresh = compute(*args, **kwargs)
                if not (isinstance(fresh, np.ndarray) and fresh.dtype == recorded.dtype
                        and np.array_equal(fresh, recorded)):
                    raise ShuffleRecordMismatch(
                        f'the shuffle recorded in {path} differs from a fresh shuffle of the '
                        f'same arguments; remove the record (or set FOUNDRYMIX_PLAN_CACHE=off) '
                        f'and report this')
            logger.info('shuffle: read from %s', path)
            return recorded
        fresh = compute(*args, **kwargs)
        if isinstance(fresh, np.ndarray) and fresh.nbytes <= MAX_RECORD_BYTES:
            _write(path, self.folder, fresh)
        return fresh


def _key(arguments: dict[str, Any]) -> str:
    h = hashlib.sha256(f'{_FORMAT}|{_code()}'.encode())
    for name, value in arguments.items():
        h.update(name.encode() + b'=')
        if isinstance(value, np.ndarray):
            value = np.ascontiguousarray(value)
            h.update(f'{value.dtype.str}{value.shape}'.encode() + value.tobytes())
        elif isinstance(value, (str, int, float, bool, type(None))):
            h.update(f'{type(value).__name__}:{value!r}'.encode())
        else:
            raise TypeError(f'no record for a {type(value).__name__} argument')
        h.update(b'\0')
    return h.hexdigest()


def _code() -> str:
    """The versions and streaming's shuffle source: a record of other code is a miss."""
    global _code_digest
    if _code_digest is None:
        import streaming

        from foundrymix.loader.streaming_compat import shuffle_sources
        h = hashlib.sha256(f'{sys.version}|{np.__version__}|{streaming.__version__}'.encode())
        for path in shuffle_sources():
            with open(path, 'rb') as f:
                h.update(os.path.basename(path).encode() + b'\0' + f.read())
        _code_digest = h.hexdigest()
    return _code_digest


def _read(path: str, folder: str) -> Optional[np.ndarray]:
    try:
        with open(path, 'rb') as f:
            if not (is_private(os.fstat(f.fileno())) and is_private(os.stat(folder))):
                return None
            got = np.load(f, allow_pickle=False)
    except FileNotFoundError:
        return None
    except Exception as e:  # a truncated or foreign record is a miss, shuffled afresh
        logger.warning('shuffle: ignoring the unreadable record %s (%s)', path, e)
        return None
    if not isinstance(got, np.ndarray) or got.ndim != 1:
        return None
    try:
        os.utime(path)  # used: the pruning keeps the most recently used
    except OSError:
        pass
    return got


def _write(path: str, folder: str, array: np.ndarray) -> None:
    try:
        if write_private(path, folder, lambda f: np.save(f, array, allow_pickle=False)):
            _prune(folder)
    except OSError as e:
        logger.info('shuffle: not recorded in %s (%s)', folder, e)


def _prune(folder: str) -> None:
    import time
    entries = []
    for entry in os.scandir(folder):
        try:
            st = entry.stat()
            if entry.name.endswith('.npy'):
                entries.append((st.st_mtime_ns, st.st_size, entry.path))
            elif entry.name.endswith('.tmp') and st.st_mtime < time.time() - 3600:
                os.unlink(entry.path)  # a writer killed mid-write an hour ago
        except OSError:
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= KEEP_BYTES:
            break
        try:
            os.unlink(path)
        except OSError:
            pass
        total -= size
