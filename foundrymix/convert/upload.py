"""Upload a conversion to ``s3://bucket/prefix`` so that a reader never sees half a dataset.

Shards go up as finished, then ``foundrymix.json``, ``index.json`` last: a failed run leaves no
index (and deletes its uploads, best effort). ``--overwrite`` deletes the old metadata before the
first new shard and old shards only after the new index; only objects the old index lists or
foundrymix wrote (:data:`WRITER_META`) are deleted, and the old list saved as
:data:`REPLACING_NAME` lets a killed replacement be finished. Refused before tokenizing: an
unusable bucket, a non-empty prefix without ``--overwrite``, foreign shard-named objects.
Not streaming's ``S3Uploader``: it hides retries and uploads ``index.json`` before our manifest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional


from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import MANIFEST_NAME
from foundrymix.format.shards import INDEX_NAME, index_files
from foundrymix.s3.remote import S3Url, describe, list_keys, make_client
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
