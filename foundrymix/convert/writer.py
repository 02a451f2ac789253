"""Write foundrymix rows to MDS shards so that a directory is complete or absent.

Everything is written into a hidden sibling ``.<name>.partial-<pid>-<tag>`` and renamed into
place (atomic) once on disk; the next run removes a leftover whose process is gone. In the
output directory only what foundrymix wrote is ever replaced or removed (the refusals here).

For ``s3://bucket/prefix`` it is the staging area, uploaded as :mod:`foundrymix.convert.upload` says.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import shutil
import stat
import tempfile
import threading
from typing import Any, Optional

import numpy as np
import xxhash

from foundrymix.convert.output import (NAMED_ENTRIES, OutputExistsError, check_output_dir, remove_output,
                                       remove_stale_partials)
from foundrymix.convert.upload import RemoteOutputError, S3Target, Uploader
from foundrymix.errors import UserError
from foundrymix.format.mds import LeanMDSWriter
from foundrymix.format.schema import MANIFEST_NAME, Manifest, RowBatch, mds_columns, rows_of
from foundrymix.format.shards import INDEX_NAME, stored_name
from foundrymix.heap import collector_paused

logger = logging.getLogger(__name__)

#: shard hash always written (cheap)
DEFAULT_HASH = 'xxh3_64'


def supported_hashes() -> set[str]:
    """The algorithms ``streaming.base.hashing`` supports (same rule: hashlib's, except
    ``shake_*``, plus xxhash's), computed without importing streaming (and torch)."""
    algos = {a for a in hashlib.algorithms_available if hasattr(hashlib, a) and not a.startswith('shake_')}
    return algos | set(xxhash.algorithms_available)


#: streaming 0.13's shard codecs and levels, to check ``--compression`` without importing torch
COMPRESSION_LEVELS = {'br': range(0, 12), 'bz2': range(1, 10), 'gz': range(0, 10), 'snappy': range(0),
                      'zstd': range(1, 23)}


def supported_compressions() -> set[str]:
    """Every ``--compression`` value streaming accepts: a codec, or ``codec:level``."""
    return set(COMPRESSION_LEVELS) | {f'{c}:{n}' for c, levels in COMPRESSION_LEVELS.items() for n in levels}


def check_shard_options(hashes: list[str], compression: Optional[str]) -> None:
    """Refuse, before any work, a ``--hash`` or ``--compression`` that streaming would refuse."""
    known = supported_hashes()
    unknown = [a for a in hashes if a not in known]
    if unknown:
        raise UserError(f"--hash {unknown[0]!r} is not a hash streaming supports "
                         f"(choose from {', '.join(sorted(known))})")
    if compression is not None and compression not in supported_compressions():
        levels = ', '.join(f'{c}' + (f'[:{r.start}-{r.stop - 1}]' if r else '')
                           for c, r in sorted(COMPRESSION_LEVELS.items()))
        raise UserError(f'--compression {compression!r} is not a shard compression streaming supports '
                         f'(choose from {levels})')


def mds_writer(out: str, columns: dict[str, str], compression: Optional[str], size_limit: int | str,
               hashes: list[str]) -> Any:
    """:class:`LeanMDSWriter` (no streaming import) or, compressed, ``streaming.MDSWriter``."""
    if compression is None:
        return LeanMDSWriter(out, columns, hashes=hashes, size_limit=size_limit)
    # imported here, in the writer thread, after the conversion workers were forked
    with collector_paused():  # importing makes it run over and over, finding nothing
        from streaming import MDSWriter
    return MDSWriter(out=out, columns=columns, compression=compression, size_limit=size_limit,
                     hashes=hashes, progress_bar=False, exist_ok=False)


def write_rows(writer: Any, item: dict[str, Any] | RowBatch) -> None:
    """Write one row, or a :class:`RowBatch` in one go where ``writer`` can (streaming's cannot)."""
    if not isinstance(item, RowBatch):
        writer.write(item)
    elif hasattr(writer, 'write_batch'):
        writer.write_batch(item.columns())
    else:
        for row in item.rows():
            writer.write(row)


#: rows waiting for the writer thread are capped at about this many bytes of tokens
QUEUE_BYTES = 64 << 20


_FINISH = object()


class ShardWriter(contextlib.AbstractContextManager):
    """An ``MDSWriter`` over the foundrymix columns that publishes atomically.

    Use as a context manager; :meth:`finish` publishes, leaving without it deletes the
    partial directory. Rows are written by a background thread behind a queue bounded to
    about ``QUEUE_BYTES``; its errors are raised by the next :meth:`write` or :meth:`finish`.
    """

    def __init__(self, out: Optional[str], max_seq_len: int, token_dtype: str, overwrite: bool = False,
                 compression: Optional[str] = None, size_limit: int | str = '64mb',
                 hashes: Optional[list[str]] = None, remote: Optional[S3Target] = None, tasks: bool = False) -> None:
        """``out``: the local output directory, or None for an upload-only output (then
        ``remote``, checked by :func:`check_remote`, is required).
        ``tasks``: others (Ray tasks) write the shards into :attr:`partial`; no writer thread."""
        assert out is not None or remote is not None, 'no output given'
        self.overwrite = overwrite
        hashes = [DEFAULT_HASH] if hashes is None else sorted(set(hashes))
        if out is not None:  # checked by prepare(); _publish checks it again
            # a symbolic link to a directory: write beside, and replace, its target
            self.out: Optional[str] = os.path.realpath(out)
            parent, name = os.path.split(self.out)
            os.makedirs(parent, exist_ok=True)
        else:
            self.out = None
            parent = tempfile.gettempdir()
            name = 'foundrymix-upload-' + re.sub(r'[^A-Za-z0-9_.-]+', '_', str(remote.url)[5:])
        remove_stale_partials(parent, name)
        # the tag keeps two writers of one process (threads, notebooks) apart
        self.partial = os.path.join(parent, f'.{name}.partial-{os.getpid()}-{secrets.token_hex(4)}')
        self.rows = 0
        self._submitted = 0
        self.finished = False
        self._writer: Any = None  # LeanMDSWriter or streaming's MDSWriter
        self._uploader = None if remote is None else Uploader(remote, self.partial, keep_local=out is not None)
        self._error: Optional[BaseException] = None
        self._closed = False
        self._lock = threading.Lock()  # orders creating the MDSWriter against abort()
        row_bytes = max_seq_len * np.dtype(token_dtype).itemsize
        self._capacity = max(64, QUEUE_BYTES // row_bytes)  # rows
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # rows in the queue
        self._room = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name='foundrymix-shard-writer', daemon=True,
            args=(mds_columns(max_seq_len, token_dtype), compression, size_limit, hashes))
        if tasks:
            os.makedirs(self.partial)
        else:
            self._thread.start()

    def _run(self, columns: dict[str, str], compression: Optional[str], size_limit: int | str,
             hashes: list[str]) -> None:
        try:
            with self._lock:
                if self._closed:
                    return
                self._writer = mds_writer(self.partial, columns, compression, size_limit, hashes)
            while (item := self._queue.get()) is not None and not self._closed:  # aborted: no further row
                if item is _FINISH:
                    self._writer.finish()
                    self._upload_new_shards()
                    return
                if self._uploader is None:
                    write_rows(self._writer, item)
                else:  # row by row: a finished shard goes to the uploader before the next (bounds the disk)
                    for row in rows_of(item):
                        self._writer.write(row)
                        self._upload_new_shards()
                with self._room:
                    self._queued -= len(item) if isinstance(item, RowBatch) else 1
                    self._room.notify_all()
        except BaseException as e:  # handed to the caller's thread
            self._error = e

    def upload(self, names: list[str]) -> None:
        """Upload these files that others wrote into :attr:`partial` now (with an ``s3://`` output)."""
        for name in names if self._uploader is not None else ():
            self._uploader.submit(name)

    def _upload_new_shards(self) -> None:
        """Hand the shards closed since the last call to the uploader (blocks while it is too
        far behind, which in turn holds back :meth:`write`)."""
        shards = self._writer.shards
        self.upload([stored_name(s) for s in shards[self._submitted:]])
        self._submitted = len(shards)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._thread.is_alive():
            raise RuntimeError('shard writer thread stopped')

    def write(self, item: dict[str, Any] | RowBatch) -> None:
        """Queue one row, or a :class:`~foundrymix.format.schema.RowBatch` (written in one go);
        waits while the rows queued would pass the queue's capacity."""
        assert not self._closed, 'writer already closed'
        n = len(item) if isinstance(item, RowBatch) else 1
        if not n:
            return
        with self._room:
            self._raise_error()
            while self._queued and self._queued + n > self._capacity:
                self._room.wait(0.1)
                self._raise_error()
            self._queued += n
        self._queue.put(item)
        self.rows += n

    def finish(self, manifest: Manifest) -> None:
        """Flush shards, write index and manifest, then move the directory into place."""
        assert not self._closed, 'writer already closed'
        if manifest.counts.rows != self.rows:
            raise RuntimeError(f'manifest says {manifest.counts.rows} rows, {self.rows} were written')
        if self._thread.is_alive():
            self._queue.put(_FINISH)
            self._thread.join()
        if self._error is not None:
            raise self._error
        self._closed = True
        self._writer = None
        with open(os.path.join(self.partial, MANIFEST_NAME), 'w', encoding='utf-8') as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        if self._uploader is None:
            self._publish()
        else:
            self._finish_upload()
        self.finished = True

    def _finish_upload(self) -> None:
        """Wait for the shard uploads, publish the local copy (if kept), upload the metadata."""
        uploader = self._uploader
        with open(os.path.join(self.partial, INDEX_NAME), encoding='utf-8') as f:
            shard_files = {stored_name(s) for s in json.load(f)['shards']}
        uploader.drain()
        if self.out is not None:
            self._publish()
            uploader.local = self.out
        try:
            uploader.finish(shard_files)
        except Exception as e:
            if self.out is not None:
                raise RemoteOutputError(
                    f'{e}\nThe local copy {self.out} is complete; upload it later, e.g. '
                    f'`aws s3 sync --exclude index.json {self.out} {uploader.url}`, then index.json') from e
            raise
        if self.out is None:
            shutil.rmtree(self.partial, ignore_errors=True)

    @property
    def upload_summary(self) -> Optional[str]:
        """What the upload did (objects, MB, retries), once finished; None without upload."""
        return None if self._uploader is None else self._uploader.summary()

    def _publish(self) -> None:
        """Move the partial directory into place, re-checking ``out``: an output published
        meanwhile is left alone unless ``overwrite`` (renamed aside, replaced, then deleted).
        A replaced ``out`` keeps its permission bits and group."""
        check_output_dir(self.out, self.overwrite, late=True)
        old = None
        kept = os.stat(self.out) if os.path.isdir(self.out) else None
        if kept is not None and os.listdir(self.out):
            old = f'{self.partial}.old'
            os.rename(self.out, old)
        try:
            os.rename(self.partial, self.out)
        except OSError as e:
            if old is not None and not os.path.exists(self.out):
                os.rename(old, self.out)
            raise OutputExistsError(f'{self.out}: output directory appeared while converting (another '
                                    f'conversion into the same --out?); could not move this output '
                                    f'into place ({e}); left the other alone') from e
        if kept is not None:  # the group first (changing it clears setgid), then the permission bits
            if os.stat(self.out).st_gid != kept.st_gid:
                try:
                    os.chown(self.out, -1, kept.st_gid)
                except OSError as e:  # a group the writer may not give: left as it is
                    logger.warning('%s: could not give it back its group %d (%s)', self.out, kept.st_gid, e)
            os.chmod(self.out, stat.S_IMODE(kept.st_mode))
        if old is not None:
            left = remove_output(old)
            if left:  # written into --out in the instant between the check above and the rename
                logger.warning('%s: the replaced output held files foundrymix did not write (%s); they '
                               'are kept in %s', self.out, ', '.join(left[:NAMED_ENTRIES]), old)

    def abort(self) -> None:
        if self._uploader is not None:
            self._uploader.stop()  # a writer thread waiting to hand over a shard gives up
        with self._lock:
            self._closed = True
            started = self._writer is not None
        if started and self._thread.is_alive():  # stop the thread before removing its directory
            self._queue.put(None)
            self._thread.join()
        self._writer = None
        if self._uploader is not None:
            self._uploader.abort()
        shutil.rmtree(self.partial, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:
            self.abort()
