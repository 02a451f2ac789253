"""Upload a conversion to ``s3://bucket/prefix`` so that a reader never sees half a dataset.

Why this order: readers (streaming, ``foundrymix inspect|verify|plan``) take a prefix as a
dataset once ``index.json`` is there. So shards are uploaded while the conversion runs,
each as soon as the shard writer has closed it, then ``foundrymix.json``, and
``index.json`` last of all. A conversion that fails or is killed before that leaves no
index at the prefix; on a failure this process can still report, it also deletes what it
uploaded (best effort: an endpoint that stopped answering cannot be cleaned).

Replacing a dataset (``--overwrite``): the old ``index.json`` and ``foundrymix.json`` are
deleted *before* the first new shard is uploaded (new shards may reuse old shard names,
and a reader must never pair the old index with new shards), and old shards that the new
dataset does not reuse are deleted only after the new index is up. Only objects listed in
the old index are ever deleted, plus objects this conversion or an interrupted earlier
one wrote (each upload carries the metadata ``foundrymix-writer``); anything else at the
prefix is the user's and is left alone.

What is refused up front, before any tokenizing: a bucket that does not exist or cannot
be read, credentials S3 rejects, an endpoint that does not answer (each naming the URL
and S3's error code); a prefix that holds a dataset (``index.json`` or
``foundrymix.json``) or any other object, unless ``--overwrite``; and, even with
``--overwrite``, a prefix holding objects named like shards (``shard.NNNNN.mds...``,
``task-NNNNN/...``) that foundrymix did not write, since a new shard could replace them.

Why boto3 and not streaming's ``S3Uploader``: that uploader retries with its own loop,
hides the attempts, uploads ``index.json`` inside ``MDSWriter.finish`` (before our
manifest, and even after a failed shard upload has only been logged), and has no notion
of replacing a dataset safely. Here one boto3 client (thread-safe) uses botocore's
``standard`` retry mode (exponential backoff with jitter on throttling such as 503
``SlowDown``, 5xx, connection resets and timeouts; ``AWS_MAX_ATTEMPTS`` sets the attempts,
default 8), and a ``needs-retry`` event handler counts every failed attempt by reason, so
the summary can say how many retries the upload took. Credentials and endpoint are found
as streaming finds them: boto3's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``~/.aws``, instance roles) and ``S3_ENDPOINT_URL`` for S3-compatible
stores.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from foundrymix.schema import MANIFEST_NAME

logger = logging.getLogger(__name__)

INDEX_NAME = 'index.json'
#: S3 object metadata set on every object a conversion uploads (``x-amz-meta-foundrymix-writer``)
WRITER_META = {'foundrymix-writer': 'convert'}
#: object names a conversion writes besides the metadata files
_SHARD_NAME = re.compile(r'^(task-\d+/)?shard\.\d+\.mds(\.[A-Za-z0-9:_-]+)?$')
#: shard uploads in flight at once, and shards finished but not yet uploaded that the
#: shard writer may get ahead by (so local disk holds at most about this many shards)
UPLOAD_THREADS = 4
MAX_PENDING = 2 * UPLOAD_THREADS
DEFAULT_ATTEMPTS = 8


class RemoteOutputError(ValueError):
    """The S3 output prefix cannot be written (named, with the S3 error code), or is not empty."""


@dataclass(frozen=True)
class S3Url:
    """``s3://bucket/prefix``; ``prefix`` without leading or trailing slashes ('' = bucket root)."""

    bucket: str
    prefix: str

    def key(self, name: str) -> str:
        return f'{self.prefix}/{name}' if self.prefix else name

    def url(self, name: str = '') -> str:
        key = self.key(name) if name else self.prefix
        return f's3://{self.bucket}/{key}'.rstrip('/')

    def __str__(self) -> str:
        return self.url()


def parse_s3_url(url: str) -> S3Url:
    """Split ``s3://bucket/prefix``; other schemes are refused (only S3 uploads are supported)."""
    scheme, sep, rest = url.partition('://')
    if not sep or scheme.lower() != 's3':
        raise RemoteOutputError(f'--out {url}: only s3://bucket/prefix is supported as a remote output '
                                f'(for another store, convert to a local directory and copy it)')
    bucket, _, prefix = rest.partition('/')
    if not bucket:
        raise RemoteOutputError(f'--out {url}: no bucket name (expected s3://bucket/prefix)')
    return S3Url(bucket, prefix.strip('/'))


def error_code(error: BaseException) -> str:
    """S3's error code (``NoSuchBucket``, ``InvalidAccessKeyId``, ``SlowDown``...), or the
    exception's class name for errors below HTTP (connection refused, timeouts)."""
    response = getattr(error, 'response', None)
    if isinstance(response, dict):
        code = response.get('Error', {}).get('Code')
        if code:
            return str(code)
    return type(error).__name__


def _hint(code: str) -> str:
    if code in ('NoSuchBucket', '404', 'NotFound'):
        return 'check the bucket name and the endpoint (S3_ENDPOINT_URL)'
    if code in ('InvalidAccessKeyId', 'SignatureDoesNotMatch', 'AccessDenied', '403', 'Forbidden',
                'NoCredentialsError', 'PartialCredentialsError', 'ExpiredToken'):
        return ('check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) '
                'and that they may list, read, write and delete under this prefix')
    return 'check that the endpoint is up and reachable (S3_ENDPOINT_URL, network, proxy settings)'


def describe(action: str, url: str, error: BaseException) -> str:
    """One message naming the URL, what was attempted, S3's error code and what to check."""
    code = error_code(error)
    return f'{url}: {action} failed ({code}: {error}); {_hint(code)}'


@dataclass
class RetryCounter:
    """Failed attempts botocore retried, by reason (S3 error code, HTTP status, exception).

    Counted in a ``needs-retry`` handler, which botocore calls after every attempt; an
    attempt counts when it raised (reset, timeout) or got a 5xx/429 answer. The last failed
    attempt of a request that fails for good is counted too, but then the upload fails.
    """

    reasons: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, response: Any = None, caught_exception: Optional[BaseException] = None,
                 **_: Any) -> None:
        reason = None
        if caught_exception is not None:
            reason = type(caught_exception).__name__
        elif response is not None:
            http, parsed = response
            if http.status_code >= 500 or http.status_code == 429:
                reason = (parsed or {}).get('Error', {}).get('Code') or f'HTTP {http.status_code}'
        if reason is not None:
            with self._lock:
                self.reasons[reason] += 1
        return None  # never decides whether to retry: botocore's own handler does

    @property
    def total(self) -> int:
        return sum(self.reasons.values())

    def summary(self) -> str:
        """Objects and MB uploaded, seconds from the first shard handed over to the index
        uploaded (the upload overlaps the conversion), retries by reason, old shards removed."""
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
