"""Write foundrymix rows to MDS shards so that a directory is complete or absent.

Why write aside and rename: a conversion killed half-way (Ctrl-C, SIGKILL, a full
disk) must never leave a directory that looks finished. Shards, ``index.json`` and
``foundrymix.json`` are written into a hidden sibling directory; only when all of
them are on disk is that directory renamed to the requested output path (a rename on
one filesystem is atomic). A leftover ``.<name>.partial-<pid>-<tag>`` is obviously
partial; the next run removes it once its process ``pid`` is gone (a live one may be a
conversion into the same ``--out`` running right now, and is left alone).

With an ``s3://`` output (:mod:`foundrymix.convert.upload`) the same hidden directory is
the staging area: each shard is uploaded as soon as it is closed (and, without a local
copy, deleted once uploaded; the directory then lives in the system temp dir), and
``foundrymix.json`` and ``index.json`` go up last. With a local copy as well, the local
directory is published first (it is complete), then the remote metadata.

Shards are hashed into ``index.json`` (``xxh3_64`` by default, fast enough to be free;
more with ``--hash``), so streaming's ``validate_hash`` can check downloaded shards.
"""

from __future__ import annotations

import glob
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

from foundrymix.format.mds import LeanMDSWriter
from foundrymix.convert.paths import check_out_url
from foundrymix.convert.pipeline import importing
from foundrymix.convert.upload import (INDEX_NAME, SHARD_NAME, RemoteOutputError, S3Target, Uploader,
                                       index_files, shard_file)
from foundrymix.errors import FoundrymixError, UserError
from foundrymix.format.schema import MANIFEST_NAME, Manifest, RowBatch, mds_columns

logger = logging.getLogger(__name__)


class OutputExistsError(FoundrymixError, FileExistsError):
    """The output directory exists and is not empty, and ``overwrite`` was not given; or it
    holds files foundrymix did not write, which ``overwrite`` never replaces."""


#: foreign entries named in a refusal (the rest are counted)
NAMED_ENTRIES = 3


def owned_files(out: str) -> set[str]:
    """Files in ``out`` that a foundrymix conversion wrote, relative to it.

    Those are ``foundrymix.json``, ``index.json`` and the shard files that index lists,
    ``shard.NNNNN.mds[.ext]`` or, from ``--engine ray``, ``task-NNNNN/shard...`` (names
    checked, so a hand-edited index cannot claim other files). Without both metadata files
    (e.g. streaming's own ``MDSWriter`` output) nothing is foundrymix's. A conversion that
    is killed leaves nothing else inside ``out``: it writes into a hidden sibling directory
    and renames it into place (see :meth:`ShardWriter._publish`).
    """
    meta = [os.path.join(out, n) for n in (MANIFEST_NAME, INDEX_NAME)]
    if not all(os.path.isfile(p) and not os.path.islink(p) for p in meta):
        return set()
    try:
        with open(meta[1], encoding='utf-8') as f:
            listed = index_files(json.load(f))
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        listed = set()  # unreadable index: its shards cannot be told from the user's files
    return {MANIFEST_NAME, INDEX_NAME} | {n for n in listed if SHARD_NAME.match(n)}


def foreign_entries(out: str) -> list[str]:
    """Entries of directory ``out`` that foundrymix did not write (folders with a trailing
    ``/``; inside a ``task-NNNNN/`` folder of shards, its foreign files), sorted."""
    owned = owned_files(out)
    folders = {n.split('/', 1)[0] for n in owned if '/' in n}
    foreign = []
    for entry in sorted(os.listdir(out)):
        path = os.path.join(out, entry)
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        if is_dir and entry in folders:
            for sub in sorted(os.listdir(path)):
                rel = f'{entry}/{sub}'
                if rel not in owned or os.path.isdir(os.path.join(path, sub)):
                    foreign.append(rel)
        elif is_dir or entry not in owned:
            foreign.append(f'{entry}/' if is_dir else entry)
    return foreign


def _foreign_message(out: str, foreign: list[str]) -> str:
    named = ', '.join(foreign[:NAMED_ENTRIES])
    more = f' and {len(foreign) - NAMED_ENTRIES:,} more' if len(foreign) > NAMED_ENTRIES else ''
    no_manifest = f'; it has no {MANIFEST_NAME}' if not os.path.isfile(os.path.join(out, MANIFEST_NAME)) \
        and MANIFEST_NAME not in foreign and any(e == INDEX_NAME for e in foreign) else ''
    return (f'{out} holds files foundrymix did not write ({named}{more}{no_manifest}); --overwrite replaces '
            f'only a foundrymix dataset ({MANIFEST_NAME}, {INDEX_NAME} and the shards {INDEX_NAME} lists). '
            f'Choose another --out, or remove them yourself')


def check_output_dir(out: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite``, and even with it one that
    holds anything foundrymix did not write (checked before any work).

    Why: ``--overwrite`` once replaced whatever ``--out`` named; a typo in ``--out`` (a
    project folder) deleted the whole tree, exit 0. Now only a foundrymix dataset is
    replaced, as an ``s3://`` prefix keeps objects foundrymix did not write
    (:mod:`foundrymix.convert.upload`).
    """
    check_can_create(out)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise OutputExistsError(f'{out}: output path exists and is not a directory')
        foreign = foreign_entries(out)
        if foreign:  # with or without overwrite: advice to pass it would not work
            raise OutputExistsError(_foreign_message(out, foreign))
        if os.listdir(out) and not overwrite:
            raise OutputExistsError(
                f'{out}: output directory is not empty; pass --overwrite to replace it')


def check_can_create(out: str) -> None:
    """Refuse an ``out`` whose parent cannot hold it: the nearest existing ancestor is a file,
    or this process may not create entries in it (the work directory is made beside ``out``).

    Why: these failed after the tokenizer had loaded, with ``[Errno 13] Permission denied``
    or ``[Errno 17] File exists`` naming a hidden work directory or a file the user never
    thought of as ``--out``'s parent.
    """
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f'{out}: cannot be created, {parent} is a file, not a directory')
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f'{out}: cannot be created, no permission to write in {parent}; choose '
                         f'another --out, or make {parent} writable')


def remove_output(out: str) -> list[str]:
    """Delete the files foundrymix wrote in ``out`` (:func:`owned_files`), then its emptied
    ``task-NNNNN/`` folders and ``out`` itself if nothing is left; what is not foundrymix's
    stays. Returns the entries left (:func:`foreign_entries`)."""
    owned = owned_files(out)
    # the index last: a removal cut short can be finished by the next call
    for name in sorted(owned, key=lambda n: (n == INDEX_NAME, n == MANIFEST_NAME, n)):
        try:
            os.remove(os.path.join(out, name))
        except FileNotFoundError:
            pass
    for folder in {n.split('/', 1)[0] for n in owned if '/' in n}:
        try:
            os.rmdir(os.path.join(out, folder))
        except OSError:  # not empty (or gone): left alone
            pass
    try:
        os.rmdir(out)
        return []
    except OSError:
        return sorted(os.listdir(out)) if os.path.isdir(out) else []


#: shard hash written by default: xxh3_64 hashes at tens of GB/s, so it costs nothing
DEFAULT_HASH = 'xxh3_64'


def supported_hashes() -> set[str]:
    """The algorithms ``streaming.base.hashing`` supports (same rule: hashlib's, except
    ``shake_*``, plus xxhash's), computed without importing streaming (and torch)."""
    import xxhash
    algos = {a for a in hashlib.algorithms_available if hasattr(hashlib, a) and not a.startswith('shake_')}
    return algos | set(xxhash.algorithms_available)


def check_hashes(algos: list[str]) -> None:
    known = supported_hashes()
    unknown = [a for a in algos if a not in known]
    if unknown:
        raise UserError(f"--hash {unknown[0]!r} is not a hash streaming supports "
                         f"(choose from {', '.join(sorted(known))})")


#: streaming 0.13's shard codecs and their levels (``streaming.base.compression``), kept here
#: so that the check needs no torch import; ``tests/convert/test_bad_inputs.py`` compares
#: the two. A wrong ``--compression`` stopped the conversion with streaming's bare
#: ``ValueError: Invalid compression`` traceback once the shard writer had started.
COMPRESSION_LEVELS = {'br': range(0, 12), 'bz2': range(1, 10), 'gz': range(0, 10), 'snappy': range(0),
                      'zstd': range(1, 23)}


def supported_compressions() -> set[str]:
    """Every ``--compression`` value streaming accepts: a codec, or ``codec:level``."""
    return set(COMPRESSION_LEVELS) | {f'{c}:{n}' for c, levels in COMPRESSION_LEVELS.items() for n in levels}


def check_compression(compression: Optional[str]) -> None:
    if compression is not None and compression not in supported_compressions():
        levels = ', '.join(f'{c}' + (f'[:{r.start}-{r.stop - 1}]' if r else '')
                           for c, r in sorted(COMPRESSION_LEVELS.items()))
        raise UserError(f'--compression {compression!r} is not a shard compression streaming supports '
                         f'(choose from {levels})')


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``os.kill(pid, 0)``: no signal is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _keep_owned_attributes(path: str, was: os.stat_result) -> None:
    """Give the published directory ``path`` the group and permission bits (setgid and sticky
    included) the directory it replaced had (``was``). The group first: changing it clears
    setgid. A group the writer may not give (not one of its groups) is left as it is, and
    said in the log."""
    st = os.stat(path)
    if st.st_gid != was.st_gid:
        try:
            os.chown(path, -1, was.st_gid)
        except OSError as e:
            logger.warning('%s: could not give it back its group %d (%s)', path, was.st_gid, e)
    os.chmod(path, stat.S_IMODE(was.st_mode))


def remove_stale_partials(parent: str, name: str) -> list[str]:
    """Remove ``.<name>.partial-<pid>[-<tag>]`` directories whose process is dead.

    Those of live processes (another conversion into the same ``--out``, or this one)
    are kept. Returns the removed paths.
    """
    removed = []
    pattern = re.compile(rf'^\.{re.escape(name)}\.partial-(\d+)(?:-[0-9a-f]+)?(?:\.old)?$')
    for stale in glob.glob(os.path.join(glob.escape(parent), f'.{glob.escape(name)}.partial-*')):
        match = pattern.match(os.path.basename(stale))
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if stale.endswith('.old'):  # a replaced output (see ShardWriter._publish): its files only
            left = remove_output(stale)
            if left:
                logger.warning('%s: kept (a replaced output holding files foundrymix did not write: %s)',
                               stale, ', '.join(left[:NAMED_ENTRIES]))
                continue
        else:
            shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    return removed


def _mds_writer(out: str, columns: dict[str, str], compression: Optional[str], size_limit: int | str,
                hashes: list[str]) -> Any:
    """The MDS writer for ``out``: uncompressed shards without importing ``streaming`` (and
    so torch: seconds of a core, see :mod:`foundrymix.format.mds`), compressed ones
    through ``streaming.MDSWriter``; both write the same files."""
    if compression is None:
        return LeanMDSWriter(out, columns, hashes=hashes, size_limit=size_limit)
    # imported here, off the caller's thread: streaming imports torch, which conversion
    # workers forked before never need
    with importing('streaming'):
        from streaming import MDSWriter
    return MDSWriter(out=out, columns=columns, compression=compression, size_limit=size_limit,
                     hashes=hashes, progress_bar=False, exist_ok=False)


#: rows waiting for the writer thread are capped at about this many bytes of tokens
QUEUE_BYTES = 64 << 20
_FINISH = object()


class ShardWriter:
    """An ``MDSWriter`` over the foundrymix columns that publishes atomically.

    Use as a context manager; call :meth:`finish` with the manifest to publish. Leaving
    the block without ``finish`` (an exception) deletes the partial directory.

    Rows are written by a background thread (which, for compressed output only, also
    imports ``streaming``: torch and torchvision, seconds of one core). So :meth:`write`
    returns at once and the conversion keeps its workers busy; a bounded queue (about
    ``QUEUE_BYTES`` of tokens) keeps memory flat. An error in the thread is raised by
    the next :meth:`write` or by :meth:`finish`.
    """

    def __init__(self, out: Optional[str], max_seq_len: int, token_dtype: str, overwrite: bool = False,
                 compression: Optional[str] = None, size_limit: int | str = '64mb',
                 hashes: Optional[list[str]] = None, remote: Optional[S3Target] = None) -> None:
        """``out``: the local output directory, or None for an upload-only output (then
        ``remote``, checked by :func:`~foundrymix.convert.upload.check_remote`, is required)."""
        assert out is not None or remote is not None, 'no output given'
        self.overwrite = overwrite
        hashes = [DEFAULT_HASH] if hashes is None else sorted(set(hashes))
        check_hashes(hashes)
        if out is not None:
            check_out_url(out)
            # a symbolic link to a directory: write beside, and replace, its target
            self.out: Optional[str] = os.path.realpath(out)
            check_output_dir(self.out, overwrite)
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
        self._queue: queue.Queue = queue.Queue(maxsize=self._capacity)
        self._batch_rows = 0  # rows of RowBatch items queued (each takes one slot of the queue)
        self._batch_room = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name='foundrymix-shard-writer', daemon=True,
            args=(mds_columns(max_seq_len, token_dtype), compression, size_limit, hashes))
        self._thread.start()

    def _run(self, columns: dict[str, str], compression: Optional[str], size_limit: int | str,
             hashes: list[str]) -> None:
        try:
            with self._lock:
                if self._closed:
                    return
                self._writer = _mds_writer(self.partial, columns, compression, size_limit, hashes)
            while True:
                row = self._queue.get()
                if row is _FINISH:
                    self._writer.finish()
                    self._upload_new_shards()
                    return
                if row is None:  # abort
                    return
                if isinstance(row, RowBatch):
                    self._write_batch(row)
                else:
                    self._writer.write(row)
                self._upload_new_shards()
        except BaseException as e:  # handed to the caller's thread
            self._error = e

    def _write_batch(self, batch: RowBatch) -> None:
        if hasattr(self._writer, 'write_batch'):
            self._writer.write_batch(batch.columns())
        else:  # streaming's MDSWriter (compressed output)
            for row in batch.rows():
                self._writer.write(row)
        with self._batch_room:
            self._batch_rows -= len(batch)
            self._batch_room.notify_all()

    def _upload_new_shards(self) -> None:
        """Hand the shards the MDS writer has closed since the last call to the uploader
        (``MDSWriter.shards`` gets an entry once its file is written); blocks while the
        uploader is too far behind, which in turn holds back :meth:`write`."""
        if self._uploader is None:
            return
        shards = self._writer.shards
        while self._submitted < len(shards):
            self._uploader.submit(shard_file(shards[self._submitted]))
            self._submitted += 1

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

    def write(self, row: dict[str, Any] | RowBatch) -> None:
        """Queue one row, or a :class:`~foundrymix.format.schema.RowBatch` (written in one go;
        batches wait while the rows of those queued would pass the queue's capacity)."""
        assert not self._closed, 'writer already closed'
        if not isinstance(row, RowBatch):
            self._put(row)
            self.rows += 1
            return
        n = len(row)
        if not n:
            return
        with self._batch_room:
            while self._batch_rows and self._batch_rows + n > self._capacity:
                self._raise_error()
                if not self._thread.is_alive():
                    raise RuntimeError('shard writer thread stopped')
                self._batch_room.wait(0.1)
            self._batch_rows += n
        self._put(row)
        self.rows += n

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
        if self._uploader is None:
            self._publish()
        else:
            self._finish_upload()
        self.finished = True
        return self.out or str(self._uploader.url)

    def _finish_upload(self) -> None:
        """Wait for the shard uploads, publish the local copy (if kept), then upload the
        manifest and index last; without a local copy the staging directory goes."""
        uploader = self._uploader
        with open(os.path.join(self.partial, INDEX_NAME), encoding='utf-8') as f:
            shard_files = {shard_file(s) for s in json.load(f)['shards']}
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
        """Move the partial directory into place, re-checking ``out`` first.

        Another conversion may have published the same ``out`` while this one ran: without
        ``overwrite`` that output is left alone and this one fails (its partial directory is
        removed by :meth:`abort`). With ``overwrite`` the old output is renamed aside before
        the new one moves in and only then deleted, so ``out`` is never missing for long.

        An ``out`` directory that existed (empty, or replaced with ``overwrite``) keeps its
        permission bits and group: the rename puts the partial directory (mode from the
        umask) in its place, and a team's ``2775`` folder became ``755`` with the writer's
        group, or a ``555`` one writable (:func:`_keep_owned_attributes`).
        """
        if os.path.lexists(self.out):
            if not os.path.isdir(self.out) or os.path.islink(self.out):
                raise OutputExistsError(f'{self.out}: output path appeared while converting and is '
                                        f'not a directory; left it alone')
            if os.listdir(self.out) and not self.overwrite:
                raise OutputExistsError(
                    f'{self.out}: output directory appeared while converting (another conversion '
                    f'into the same --out?); left it alone and discarded this output. Pass '
                    f'--overwrite to replace it, or choose another --out')
            foreign = foreign_entries(self.out)  # written there while this conversion ran
            if foreign:
                raise OutputExistsError(_foreign_message(self.out, foreign) + '; discarded this output')
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
        if kept is not None:
            _keep_owned_attributes(self.out, kept)
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
        if self._uploader is not None:
            self._uploader.abort()
        shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> 'ShardWriter':
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finished:
            self.abort()
