"""Write foundrymix rows to MDS shards so that a directory is complete or absent.

Why write aside and rename: a conversion killed half-way (Ctrl-C, SIGKILL, a full
disk) must never leave a directory that looks finished. Shards, ``index.json`` and
``foundrymix.json`` are written into a hidden sibling directory; only when all of
them are on disk is that directory renamed to the requested output path (a rename on
one filesystem is atomic). A leftover ``.<name>.partial-<pid>`` is obviously partial
and is removed by the next run.
"""

from __future__ import annotations

import glob
import os
import queue
import shutil
import threading
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from foundrymix.convert.pipeline import importing
from foundrymix.schema import MANIFEST_NAME, Manifest, mds_columns

if TYPE_CHECKING:
    from streaming import MDSWriter


class OutputExistsError(FileExistsError):
    """The output directory exists and is not empty, and ``overwrite`` was not given."""


def check_output_dir(out: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite`` (checked before any work)."""
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise OutputExistsError(f'{out}: output path exists and is not a directory')
        if os.listdir(out) and not overwrite:
            raise OutputExistsError(
                f'{out}: output directory is not empty; pass --overwrite to replace it')


#: rows waiting for the writer thread are capped at about this many bytes of tokens
QUEUE_BYTES = 64 << 20
_FINISH = object()


class ShardWriter:
    """An ``MDSWriter`` over the foundrymix columns that publishes atomically.

    Use as a context manager; call :meth:`finish` with the manifest to publish. Leaving
    the block without ``finish`` (an exception) deletes the partial directory.

    Rows are written by a background thread, which also imports ``streaming`` (it
    pulls in torch and torchvision: seconds of one core). So :meth:`write` returns at
    once and the conversion keeps its workers busy meanwhile; a bounded queue (about
    ``QUEUE_BYTES`` of tokens) keeps memory flat. An error in the thread is raised by
    the next :meth:`write` or by :meth:`finish`.
    """

    def __init__(self, out: str, max_seq_len: int, token_dtype: str, overwrite: bool = False,
                 compression: Optional[str] = None, size_limit: int | str = '64mb') -> None:
        self.out = os.path.abspath(out)
        check_output_dir(self.out, overwrite)
        parent, name = os.path.split(self.out)
        os.makedirs(parent, exist_ok=True)
        for stale in glob.glob(os.path.join(parent, f'.{name}.partial-*')):
            shutil.rmtree(stale, ignore_errors=True)
        self.partial = os.path.join(parent, f'.{name}.partial-{os.getpid()}')
        self.rows = 0
        self.finished = False
        self._writer: Optional['MDSWriter'] = None
        self._error: Optional[BaseException] = None
        self._closed = False
        self._lock = threading.Lock()  # orders creating the MDSWriter against abort()
        row_bytes = max_seq_len * np.dtype(token_dtype).itemsize
        self._queue: queue.Queue = queue.Queue(maxsize=max(64, QUEUE_BYTES // row_bytes))
        self._thread = threading.Thread(
            target=self._run, name='foundrymix-shard-writer', daemon=True,
            args=(mds_columns(max_seq_len, token_dtype), compression, size_limit))
        self._thread.start()

    def _run(self, columns: dict[str, str], compression: Optional[str], size_limit: int | str) -> None:
        try:
            # imported here, off the caller's thread: streaming imports torch, which
            # conversion workers forked before never need
            with importing('streaming'):
                from streaming import MDSWriter
            with self._lock:
                if self._closed:
                    return
                self._writer = MDSWriter(out=self.partial, columns=columns, compression=compression,
                                         size_limit=size_limit, progress_bar=False, exist_ok=False)
            while True:
                row = self._queue.get()
                if row is _FINISH:
                    self._writer.finish()
                    return
                if row is None:  # abort
                    return
                self._writer.write(row)
        except BaseException as e:  # handed to the caller's thread
            self._error = e

    def _put(self, item: Any) -> None:
        while True:
            self._raise_error()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    self._raise_error()
                    raise RuntimeError('shard writer thread stopped')

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, row: dict[str, Any]) -> None:
        assert not self._closed, 'writer already closed'
        self._put(row)
        self.rows += 1

    def finish(self, manifest: Manifest) -> str:
        """Flush shards, write index and manifest, then move the directory into place."""
        assert not self._closed, 'writer already closed'
        if manifest.counts.rows != self.rows:
            raise RuntimeError(f'manifest says {manifest.counts.rows} rows, {self.rows} were written')
        self._put(_FINISH)
        self._thread.join()
        self._raise_error()
        self._closed = True
        self._writer = None
        with open(os.path.join(self.partial, MANIFEST_NAME), 'w', encoding='utf-8') as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(self.out):
            shutil.rmtree(self.out)  # overwrite was checked in __init__
        os.rename(self.partial, self.out)
        self.finished = True
        return self.out

    def abort(self) -> None:
        with self._lock:
            self._closed = True
            started = self._writer is not None
        if started and self._thread.is_alive():
            # stop the thread (it writes no further rows) before removing its directory
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._queue.put(None)
            self._thread.join()
        self._writer = None
        shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> 'ShardWriter':
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:
            self.abort()
