"""Write foundrymix rows to MDS shards so that a directory is complete or absent.

Everything is written into a hidden sibling ``.<name>.partial-<pid>-<tag>`` and renamed into
place (atomic) once on disk; the next run removes a leftover whose process is gone. In the
output directory only what foundrymix wrote is ever replaced or removed (the refusals here).

For ``s3://bucket/prefix`` it is the staging area, so that a reader never sees half a dataset:
shards go up as finished, then ``foundrymix.json``, ``index.json`` last: a failed run leaves no
index (and deletes its uploads, best effort). ``--overwrite`` deletes the old metadata before the
first new shard and old shards only after the new index; only objects the old index lists or
foundrymix wrote (:data:`WRITER_META`) are deleted, and the old list saved as
:data:`REPLACING_NAME` lets a killed replacement be finished. Refused before tokenizing: an
unusable bucket, a non-empty prefix without ``--overwrite``, foreign shard-named objects.
Not streaming's ``S3Uploader``: it hides retries and uploads ``index.json`` before our manifest.
"""

from __future__ import annotations

import contextlib
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import xxhash

from foundrymix.claims import pid_alive
from foundrymix.format.mds import LeanMDSWriter
from foundrymix.errors import FoundrymixError, UserError
from foundrymix.heap import collector_paused
from foundrymix.format.schema import MANIFEST_NAME, Manifest, RowBatch, mds_columns, rows_of
from foundrymix.format.shards import INDEX_NAME, index_files, stored_name
from foundrymix.s3.client import S3Url, describe, list_keys, make_client
from foundrymix.s3.retries import S3RetryCounter

logger = logging.getLogger(__name__)

#: the replaced dataset's shard list, written before its index is deleted (``--overwrite``)
REPLACING_NAME = '.foundrymix-replacing.json'
#: S3 object metadata set on every object a conversion uploads (``x-amz-meta-foundrymix-writer``)
WRITER_META = {'foundrymix-writer': 'convert'}
#: object names a conversion writes besides the metadata files
SHARD_NAME = re.compile(r'^(task-\d+/)?shard\.\d+\.mds(\.[A-Za-z0-9:_-]+)?$')
#: shard uploads in flight, and finished shards the writer may get ahead by (bounds local disk)
UPLOAD_THREADS = 4
MAX_PENDING = 2 * UPLOAD_THREADS


class RemoteOutputError(FoundrymixError, ValueError):
    """The S3 output prefix cannot be written (named, with the S3 error code), or is not empty."""


def parse_s3_url(url: str, flag: str = '--out') -> S3Url:
    """Split ``s3://bucket/prefix``; other schemes are refused (only S3 uploads are supported)."""
    scheme, sep, rest = url.partition('://')
    if not sep or scheme.lower() != 's3':
        what, fix = (('output', 'convert to a local directory and copy it') if flag == '--out' else
                     ('source', 'copy it to a local directory first'))  # a source (adopt): read a local copy
        raise RemoteOutputError(f'{flag} {url}: only s3://bucket/prefix is supported as a remote {what} '
                                f'(for another store, {fix})')
    bucket, _, prefix = rest.partition('/')
    if not bucket:
        raise RemoteOutputError(f'{flag} {url}: no bucket name (expected s3://bucket/prefix)')
    return S3Url(bucket, prefix.strip('/'))


@dataclass
class S3Target:
    """A checked output prefix: what it held at the start and may replace, its clients (uploads;
    quick checks and clean-up) and their retry counter."""

    url: S3Url
    old_metadata: list[str]  # index.json / foundrymix.json present (deleted first on overwrite)
    replaceable: set[str]  # shard files of the old index, and leftovers foundrymix wrote
    keys: set[str]  # everything under the prefix at the start
    client: Any
    quick: Any
    retries: S3RetryCounter


def _call(what: str, url: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, an S3 error raised as :class:`RemoteOutputError` naming ``what``, ``url`` and S3's code."""
    from botocore.exceptions import BotoCoreError, ClientError
    try:
        return fn()
    except (ClientError, BotoCoreError) as e:
        raise RemoteOutputError(describe(what, url, e)) from e


def check_remote(url: str, overwrite: bool) -> S3Target:
    """Parse ``url``, connect, and check the prefix before any tokenizing; refuse what must not
    be written over."""
    s3 = parse_s3_url(url)
    retries = S3RetryCounter()
    client = make_client(retries, threads=UPLOAD_THREADS)
    # the up-front check fails fast: few attempts, short timeouts
    quick = make_client(retries, max_attempts=3, connect_timeout=5, read_timeout=10, threads=UPLOAD_THREADS)
    keys = _call('listing the prefix', str(s3), lambda: list_keys(quick, s3))  # a LIST, not HEAD: it names S3's code
    metadata = [n for n in (INDEX_NAME, MANIFEST_NAME) if n in keys]
    if keys and not overwrite:
        what = (f'holds a dataset ({", ".join(metadata)})' if metadata else
                f'is not empty ({len(keys)} object(s), e.g. {sorted(keys)[0]!r}; leftovers of an '
                f'interrupted conversion have no index.json)')
        raise RemoteOutputError(f'--out {s3}: the prefix {what}; pass --overwrite to replace it '
                                f'(only objects foundrymix wrote are ever deleted), or choose another prefix')
    listed: set[str] = set()
    for name in (INDEX_NAME, REPLACING_NAME):  # the old index, and one a failed replacement left
        if name not in keys:
            continue
        body = _call('reading the old index', s3.url(name),
                     lambda: quick.get_object(Bucket=s3.bucket, Key=s3.key(name))['Body'].read())
        try:
            listed |= index_files(json.loads(body))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RemoteOutputError(f'{s3.url(name)}: not valid JSON of an MDS index ({e}); remove it '
                                    f'yourself if the prefix may be replaced') from e
    replaceable = {k for k in keys if k in listed}
    for key in keys:
        if key in listed or key in metadata or key == REPLACING_NAME or not SHARD_NAME.match(key):
            continue
        meta = _call('reading object metadata', s3.url(key),
                     lambda: quick.head_object(Bucket=s3.bucket, Key=s3.key(key)).get('Metadata', {}))
        if meta.get('foundrymix-writer') != WRITER_META['foundrymix-writer']:
            raise RemoteOutputError(
                f'--out {s3}: {s3.url(key)} is named like a shard but is neither listed in an '
                f'index.json there nor written by foundrymix; a new shard could replace it. Move '
                f'it, or choose another prefix')
        replaceable.add(key)  # left by an interrupted conversion
    return S3Target(s3, metadata, replaceable, set(keys), client, quick, retries)


class Uploader:
    """Uploads finished shards from ``local`` in the background, then the metadata last.

    :meth:`submit` blocks while ``MAX_PENDING`` wait (uploaded local files go unless
    ``keep_local``); the first upload error is raised by the next :meth:`submit` or :meth:`finish`."""

    def __init__(self, target: S3Target, local: str, keep_local: bool) -> None:
        self.target = target
        self.url = target.url
        self.local = local
        self.keep_local = keep_local
        self.uploaded: list[str] = []
        self.bytes = 0
        self.seconds = 0.0
        self._started = False
        self.published = False  # index.json of this conversion is up
        self.removed = 0
        self._slots = threading.BoundedSemaphore(MAX_PENDING)
        self._pool = ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix='foundrymix-upload')
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        """Before the first upload: take the old dataset's index and manifest away."""
        if self._started:
            return
        self._started = True
        self._t0 = time.perf_counter()
        if self.target.replaceable:  # remember the old shards before their index goes
            body = json.dumps({'shards': [{'raw_data': {'basename': n}}
                                          for n in sorted(self.target.replaceable)]})
            self._call('writing', REPLACING_NAME, self.target.client.put_object, Bucket=self.url.bucket,
                       Key=self.url.key(REPLACING_NAME), Body=body.encode(), Metadata=WRITER_META)
        for name in self.target.old_metadata:  # index.json first: streaming's marker
            self._call('deleting the old dataset\'s', name, self.target.client.delete_object,
                       Bucket=self.url.bucket, Key=self.url.key(name))
        if self.target.old_metadata:
            logger.info('%s: removed the old %s before uploading', self.url,
                        ' and '.join(self.target.old_metadata))

    def _call(self, action: str, name: str, fn: Any, **kwargs: Any) -> Any:
        return _call(f'{action} {name}', self.url.url(name), lambda: fn(**kwargs))

    def _put(self, name: str) -> None:
        path = os.path.join(self.local, name)
        size = os.path.getsize(path)
        with open(path, 'rb') as f:
            self._call('uploading', name, self.target.client.put_object, Bucket=self.url.bucket,
                       Key=self.url.key(name), Body=f, ContentLength=size, Metadata=WRITER_META)
        with self._lock:
            self.uploaded.append(name)
            self.bytes += size

    def _upload_shard(self, name: str) -> None:
        try:
            if self._error is None:
                self._put(name)
                if not self.keep_local:
                    os.remove(os.path.join(self.local, name))
        except BaseException as e:
            with self._lock:
                if self._error is None:
                    self._error = e
        finally:
            self._slots.release()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, name: str) -> None:
        """Upload shard file ``name`` (relative to ``local``) in the background."""
        self.raise_error()
        self._start()
        while not self._slots.acquire(timeout=0.1):
            self.raise_error()
        self._pool.submit(self._upload_shard, name)

    def drain(self) -> None:
        """Wait until every submitted shard is uploaded (raises the first upload error)."""
        self._start()
        self._pool.shutdown(wait=True)
        self.raise_error()

    def stop(self) -> None:
        """Make every later :meth:`submit` raise, and queued shards be skipped."""
        with self._lock:
            if self._error is None:
                self._error = RuntimeError('upload aborted')

    def finish(self, shard_files: set[str]) -> None:
        """After :meth:`drain`: upload ``foundrymix.json`` then ``index.json`` from ``local``,
        then delete old shards the new dataset did not replace."""
        self.drain()
        missing = shard_files - set(self.uploaded)
        assert not missing, f'shards never handed to the uploader: {sorted(missing)}'
        self._put(MANIFEST_NAME)
        self._put(INDEX_NAME)  # from here on readers see the new dataset
        self.published = True
        stale = sorted(self.target.replaceable - shard_files)
        for name in stale:
            try:
                self.target.client.delete_object(Bucket=self.url.bucket, Key=self.url.key(name))
                self.removed += 1
            except Exception as e:  # noqa: BLE001 - the new dataset is complete; say what is left
                logger.warning('%s', describe('removing the old shard', self.url.url(name), e))
                break  # the list stays in REPLACING_NAME for the next --overwrite
        else:
            if self.target.replaceable or REPLACING_NAME in self.target.keys:
                try:
                    self.target.client.delete_object(Bucket=self.url.bucket, Key=self.url.key(REPLACING_NAME))
                except Exception as e:  # noqa: BLE001
                    logger.warning('%s', describe('removing', self.url.url(REPLACING_NAME), e))
        self.seconds = time.perf_counter() - self._t0
        logger.info('%s', self.summary())

    def summary(self) -> str:
        """Objects and MB uploaded, seconds from first shard to index, retries, old shards removed."""
        removed = f'; removed {self.removed} old shard file(s)' if self.removed else ''
        return (f'uploaded {len(self.uploaded)} objects ({self.bytes / 1e6:,.1f} MB, first shard to '
                f'index {self.seconds:.1f} s) to {self.url}: {self.target.retries.summary()}{removed}')

    def abort(self) -> None:
        """Stop uploading and delete what this run uploaded, index and manifest first (best effort)."""
        self.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.published:
            return
        with self._lock:
            names = sorted(self.uploaded, key=lambda n: (n != INDEX_NAME, n != MANIFEST_NAME, n))
        for name in names:
            try:
                self.target.quick.delete_object(Bucket=self.url.bucket, Key=self.url.key(name))
            except Exception as e:  # noqa: BLE001 - the original error matters more
                logger.warning('%s', describe('removing this conversion\'s', self.url.url(name), e))
                if name in (INDEX_NAME, MANIFEST_NAME):
                    continue
                break  # the endpoint is likely gone; the prefix has no index either way


class OutputExistsError(FoundrymixError, FileExistsError):
    """The output directory exists and is not empty, and ``overwrite`` was not given; or it
    holds files foundrymix did not write, which ``overwrite`` never replaces."""


#: foreign entries named in a refusal (the rest are counted)
NAMED_ENTRIES = 3


def owned_files(out: str) -> set[str]:
    """Files in ``out`` a conversion wrote: both metadata files and the shards the index lists
    (names must match :data:`SHARD_NAME`, so an edited index claims nothing else)."""
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


def check_output_dir(out: str, overwrite: bool, late: bool = False) -> None:
    """Refuse a non-empty output directory unless ``overwrite``, and even with it one holding
    anything foundrymix did not write: a typo in ``--out`` must not delete a project. ``late``: again
    at publishing, against an ``out`` that appeared while converting (left alone, this output discarded)."""
    if not late:
        check_can_create(out)
    if not (os.path.lexists if late else os.path.exists)(out):
        return
    if not os.path.isdir(out) or (late and os.path.islink(out)):
        raise OutputExistsError(f'{out}: output path {"appeared while converting" if late else "exists"} and is '
                                f'not a directory{"; left it alone" if late else ""}')
    foreign = foreign_entries(out)
    if foreign:  # with or without overwrite: advice to pass it would not work
        named = ', '.join(foreign[:NAMED_ENTRIES])
        more = f' and {len(foreign) - NAMED_ENTRIES:,} more' if len(foreign) > NAMED_ENTRIES else ''
        no_manifest = f'; it has no {MANIFEST_NAME}' if not os.path.isfile(os.path.join(out, MANIFEST_NAME)) \
            and MANIFEST_NAME not in foreign and any(e == INDEX_NAME for e in foreign) else ''
        raise OutputExistsError(
            f'{out} holds files foundrymix did not write ({named}{more}{no_manifest}); --overwrite replaces '
            f'only a foundrymix dataset ({MANIFEST_NAME}, {INDEX_NAME} and the shards {INDEX_NAME} lists). '
            f'Choose another --out, or remove them yourself{"; discarded this output" if late else ""}')
    if os.listdir(out) and not overwrite:
        raise OutputExistsError(
            f'{out}: output directory appeared while converting (another conversion into the same --out?); '
            f'left it alone and discarded this output. Pass --overwrite to replace it, or choose another --out'
            if late else f'{out}: output directory is not empty; pass --overwrite to replace it')


def check_can_create(out: str, flag: str = '--out') -> None:
    """Refuse an ``out`` whose nearest existing ancestor is a file or not writable, before any
    work (later, the error would name the hidden work directory made beside ``out``)."""
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f'{out}: cannot be created, {parent} is a file, not a directory')
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f'{out}: cannot be created, no permission to write in {parent}; choose '
                         f'another {flag}, or make {parent} writable')


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


def remove_stale_partials(parent: str, name: str) -> list[str]:
    """Remove ``.<name>.partial-<pid>[-<tag>]`` directories whose process is dead (a live one
    may be converting into the same ``--out``). Returns the removed paths."""
    removed = []
    pattern = re.compile(rf'^\.{re.escape(name)}\.partial-(\d+)(?:-[0-9a-f]+)?(?:\.old)?$')
    for stale in glob.glob(os.path.join(glob.escape(parent), f'.{glob.escape(name)}.partial-*')):
        match = pattern.match(os.path.basename(stale))
        if match is None or pid_alive(int(match.group(1))):
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


#: shard hash always written (cheap)
DEFAULT_HASH = 'xxh3_64'


def supported_hashes() -> set[str]:
    """The algorithms ``streaming.base.hashing`` supports (same rule: hashlib's, except
    ``shake_*``, plus xxhash's), computed without importing streaming (and torch)."""
    algos = {a for a in hashlib.algorithms_available if hasattr(hashlib, a) and not a.startswith('shake_')}
    return algos | set(xxhash.algorithms_available)


def check_hashes(algos: list[str]) -> None:
    known = supported_hashes()
    unknown = [a for a in algos if a not in known]
    if unknown:
        raise UserError(f"--hash {unknown[0]!r} is not a hash streaming supports "
                         f"(choose from {', '.join(sorted(known))})")


#: streaming 0.13's shard codecs and levels, to check ``--compression`` without importing torch
#: (``tests/convert/test_bad_inputs.py`` compares them with ``streaming.base.compression``)
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

    def finish(self, manifest: Manifest) -> str:
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
        return self.out or str(self._uploader.url)

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
