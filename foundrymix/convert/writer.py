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
import shutil
from typing import TYPE_CHECKING, Any, Optional

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


class ShardWriter:
    """An ``MDSWriter`` over the foundrymix columns that publishes atomically.

    Use as a context manager; call :meth:`finish` with the manifest to publish. Leaving
    the block without ``finish`` (an exception) deletes the partial directory.
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
        # imported here: streaming imports torch (seconds), which conversion workers
        # forked before this point never need
        from streaming import MDSWriter
        self._writer: Optional['MDSWriter'] = MDSWriter(
            out=self.partial, columns=mds_columns(max_seq_len, token_dtype),
            compression=compression, size_limit=size_limit, progress_bar=False, exist_ok=False)
        self.rows = 0
        self.finished = False

    def write(self, row: dict[str, Any]) -> None:
        assert self._writer is not None, 'writer already closed'
        self._writer.write(row)
        self.rows += 1

    def finish(self, manifest: Manifest) -> str:
        """Flush shards, write index and manifest, then move the directory into place."""
        assert self._writer is not None, 'writer already closed'
        if manifest.counts.rows != self.rows:
            raise RuntimeError(f'manifest says {manifest.counts.rows} rows, {self.rows} were written')
        self._writer.finish()
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
        self._writer = None
        shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> 'ShardWriter':
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:
            self.abort()
