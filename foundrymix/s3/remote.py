"""S3: every client foundrymix makes, one bounded download, errors that say what went wrong and what to check.

:func:`make_client`: botocore's ``standard`` retries (backoff with jitter on throttling, 5xx, resets
and timeouts), bounded timeouts, attempts and failed attempts counted by reason
(:mod:`foundrymix.s3.retries`). Credentials and endpoint are boto3's chain (``AWS_ACCESS_KEY_ID``/
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws``, instance roles) and ``S3_ENDPOINT_URL`` for
S3-compatible stores; ``AWS_MAX_ATTEMPTS`` sets the attempts.

Why not streaming's S3 downloader: it leaves ``connect_timeout`` at 60 s and botocore's retries
on, so an endpoint that never answers fails long after ``download_timeout``; and its HEAD request's
error responses have no body, so wrong credentials, a missing bucket and a missing key all read
"403"/"404". Here each attempt is one ``GetObject`` with botocore's retries off and
``connect_timeout = read_timeout = download_timeout``; transient failures are retried with backoff
(logged at WARNING and counted, :mod:`foundrymix.s3.retries`), never past ``download_timeout`` after
the first attempt began. **Bound per file**: a download that cannot succeed fails within
``download_timeout`` plus client set-up; a transfer that keeps receiving bytes is not cut (the
timeout bounds each stall). :class:`RemoteError` names the URL, the S3 error code, the endpoint
and what to check.

Remotes are ``s3://`` URLs or local paths (a mounted file system): a remote path is copied.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

from foundrymix.errors import FoundrymixError
from foundrymix.s3.retries import S3RetryCounter, failure_reason, installed, watch

logger = logging.getLogger(__name__)
T = TypeVar('T')

#: attempts per file at most (each also bounded by the file's deadline)
MAX_ATTEMPTS = 5
#: first backoff between attempts, doubled each time (plus jitter)
BACKOFF_S = 0.2
#: attempts per request of a :func:`make_client` client unless ``AWS_MAX_ATTEMPTS`` says otherwise
DEFAULT_ATTEMPTS = 8

_NOT_FOUND = {'NoSuchKey', '404', 'NotFound'}
_NO_BUCKET = {'NoSuchBucket'}
_CREDENTIALS = {'InvalidAccessKeyId', 'SignatureDoesNotMatch', 'ExpiredToken', 'InvalidToken',
                'TokenRefreshRequired', 'InvalidClientTokenId', 'AuthorizationHeaderMalformed',
                'RequestTimeTooSkewed'}
_DENIED = {'AccessDenied', '403', 'AllAccessDisabled', 'AccountProblem'}
_TRANSIENT = {'SlowDown', 'Throttling', 'ThrottlingException', 'RequestTimeout',
              'InternalError', 'ServiceUnavailable', 'RequestLimitExceeded', '500', '502',
              '503', '504'}


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


def s3_code(error: BaseException) -> Optional[str]:
    """S3's error code (``NoSuchBucket``, ``SlowDown``...) or the HTTP status of a botocore
    error; None for errors below HTTP (connection refused, timeouts)."""
    response = getattr(error, 'response', None)
    if isinstance(response, dict):
        code = response.get('Error', {}).get('Code')
        if code:
            return str(code)
        status = response.get('ResponseMetadata', {}).get('HTTPStatusCode')
        return str(status) if status else None
    return None


def describe(action: str, url: str, error: BaseException) -> str:
    """One message naming the URL, what was attempted, S3's error code and what to check."""
    code = s3_code(error) or type(error).__name__
    if code in ('NoSuchBucket', '404', 'NotFound'):
        advice = 'check the bucket name and the endpoint (S3_ENDPOINT_URL)'
    elif code in ('InvalidAccessKeyId', 'SignatureDoesNotMatch', 'AccessDenied', '403', 'Forbidden',
                  'NoCredentialsError', 'PartialCredentialsError', 'ExpiredToken'):
        advice = ('check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) '
                  'and that they may list, read, write and delete under this prefix')
    else:
        advice = 'check that the endpoint is up and reachable (S3_ENDPOINT_URL, network, proxy settings)'
    return f'{url}: {action} failed ({code}: {error}); {advice}'


def make_client(retries: Optional[S3RetryCounter] = None, max_attempts: Optional[int] = None,
                connect_timeout: float = 10, read_timeout: float = 30, threads: int = 4, unsigned: bool = False) -> Any:
    """A boto3 S3 client with standard retries and bounded timeouts, whose attempts and retries go to
    ``retries`` (default: the process's installed counter, :func:`foundrymix.s3.retries.watch`): an endpoint
    that stops answering fails a request after ``max_attempts`` x ``read_timeout`` plus backoff (at most
    20 s between attempts). ``unsigned``: anonymous requests (a public bucket without credentials)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    if max_attempts is None:
        max_attempts = attempts()
    config = Config(retries={'mode': 'standard', 'total_max_attempts': max_attempts},
                    connect_timeout=connect_timeout, read_timeout=read_timeout,
                    max_pool_connections=threads + 4, **({'signature_version': UNSIGNED} if unsigned else {}))
    client = boto3.session.Session().client('s3', config=config,
                                            endpoint_url=os.environ.get('S3_ENDPOINT_URL') or None)
    return watch(client, retries)


def attempts() -> int:
    """Attempts per request: ``AWS_MAX_ATTEMPTS``, else :data:`DEFAULT_ATTEMPTS`."""
    return int(os.environ.get('AWS_MAX_ATTEMPTS') or DEFAULT_ATTEMPTS)


def list_keys(client: Any, url: S3Url) -> list[str]:
    """Every key under the prefix, relative to it (the prefix as a folder: ``prefix/``)."""
    start = f'{url.prefix}/' if url.prefix else ''
    names = []
    for page in client.get_paginator('list_objects_v2').paginate(Bucket=url.bucket, Prefix=start):
        names.extend(obj['Key'][len(start):] for obj in page.get('Contents', []))
    return names


def endpoint() -> str:
    """The S3 endpoint requests go to, for messages."""
    return os.environ.get('S3_ENDPOINT_URL') or 'AWS S3 (no S3_ENDPOINT_URL set)'


class RemoteError(FoundrymixError, ConnectionError):
    """A remote file could not be read; the message names the URL, the cause and what to check.

    ``kind`` is one of not_found, no_bucket, credentials, access_denied, unreachable,
    timeout, transient, other; ``code`` is the S3 error code or HTTP status (or the
    exception type when there is no response).
    """

    def __init__(self, url: str, kind: str, code: str, text: str) -> None:
        super().__init__(f'{url}: {text}')
        self.url, self.kind, self.code, self.text = url, kind, code, text

    def __reduce__(self) -> Any:  # picklable across processes (DataLoader workers)
        return (type(self), (self.url, self.kind, self.code, self.text))


class LocalWriteError(FoundrymixError, PermissionError):
    """A download's file may not be written here (a read-only cache): never retried or
    reported as the remote's fault."""


def local_denied(error: BaseException, local: str) -> Optional[LocalWriteError]:
    """The one-line error for a download refused on this machine's side: writing ``local`` or
    making its directory was denied (``error`` or its cause); None for any other failure."""
    e = error.__cause__ if isinstance(error, RemoteError) else error
    if not (isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and e.filename):
        return None
    failed, where = os.path.abspath(os.fsdecode(e.filename)), os.path.dirname(os.path.abspath(local))
    if os.path.dirname(failed) != where and not (where + os.sep).startswith(failed + os.sep):
        return None  # e.g. the source of a local remote: the remote's
    return LocalWriteError(f'cache directory {where}: {e.strerror.lower()} writing {failed} (the remote was not '
                           f'the problem): make it writable by this user, or point cache_root (or the '
                           f"stream's local:) at a directory this user can write")


def classify(error: BaseException, url: str, timeout: Optional[float] = None,
             attempts: int = 1, more: str = 'raise download_timeout') -> RemoteError:
    """The :class:`RemoteError` for ``error`` raised while reading ``url`` (``more``: how to give
    a failing store more time, named by a transient error's advice)."""
    if isinstance(error, RemoteError):
        return error
    from botocore.exceptions import (ConnectTimeoutError, EndpointConnectionError, NoCredentialsError,
                                     ReadTimeoutError)
    code = s3_code(error)
    bucket = urllib.parse.urlparse(url).netloc
    at = f'at {endpoint()}' if url.startswith('s3://') else ''
    tried = f' ({attempts} attempts)' if attempts > 1 else ''
    if isinstance(error, FileNotFoundError) or code in _NOT_FOUND:
        return RemoteError(url, 'not_found', code or 'FileNotFoundError',
                           f'S3 {code or "not found"}: no such object {at}; check the path after '
                           f'the bucket (the prefix)'.replace('  ', ' '))
    if code in _NO_BUCKET:
        return RemoteError(url, 'no_bucket', code,
                           f'S3 {code}: no bucket {bucket!r} {at}; check the bucket name and that '
                           f'S3_ENDPOINT_URL / the region point at the store that holds it')
    if code in _CREDENTIALS:
        return RemoteError(url, 'credentials', code,
                           f'S3 {code}: the endpoint {endpoint()} rejects the credentials; check '
                           f'AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, '
                           f'~/.aws/credentials, AWS_SESSION_TOKEN) are the ones for this endpoint')
    if code in _DENIED:
        return RemoteError(url, 'access_denied', code,
                           f'S3 {code}: access denied {at}; the credentials are valid but may not '
                           f'read this object: check the bucket policy / IAM permissions '
                           f'(s3:GetObject; without s3:ListBucket S3 answers AccessDenied for a '
                           f'missing key too) and requester pays (MOSAICML_STREAMING_AWS_REQUESTER_PAYS)')
    if isinstance(error, NoCredentialsError):
        return RemoteError(url, 'credentials', 'NoCredentials',
                           'no AWS credentials found; set AWS_ACCESS_KEY_ID / '
                           'AWS_SECRET_ACCESS_KEY or AWS_PROFILE')
    if isinstance(error, (ConnectTimeoutError, ReadTimeoutError, socket.timeout, TimeoutError)):
        limit = f'{timeout:g} s' if timeout is not None else 'the timeout'
        return RemoteError(url, 'timeout', type(error).__name__,
                           f'no answer from {endpoint()} within {limit} (download_timeout){tried}; '
                           f'check S3_ENDPOINT_URL, the network and any proxy, or raise '
                           f'download_timeout for a slow store')
    if isinstance(error, EndpointConnectionError):
        return RemoteError(url, 'unreachable', type(error).__name__,
                           f'cannot connect to {endpoint()}{tried} ({error}); check S3_ENDPOINT_URL '
                           f'and that the store is running and reachable from this machine')
    if code in _TRANSIENT or is_transient(error):
        return RemoteError(url, 'transient', code or type(error).__name__,
                           f'{code or type(error).__name__} from {endpoint()}{tried}: the store is '
                           f'failing or overloaded ({error}); try again later or {more}')
    return RemoteError(url, 'other', code or type(error).__name__,
                       f'cannot download: {type(error).__name__}: {error}')


def is_transient(error: BaseException) -> bool:
    """A failure another attempt may not meet: 5xx, throttling, a dropped or stalled connection."""
    from botocore.exceptions import (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                                     HTTPClientError, IncompleteReadError, ReadTimeoutError,
                                     ResponseStreamingError)
    code = s3_code(error)
    if code is not None:
        return code in _TRANSIENT
    return isinstance(error, (ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                              ReadTimeoutError, ResponseStreamingError, IncompleteReadError,
                              HTTPClientError, socket.timeout, TimeoutError, ConnectionResetError))


def within(call: Callable[[], T], url: str, timeout: float, max_attempts: int) -> T:
    """``call()`` (requests whose timeouts are at most ``timeout``, botocore's retries off), retried
    on transient failures with backoff and jitter, at most ``max_attempts`` times and none started
    past ``timeout`` s after the first attempt began. Retries are logged (WARNING); failures raise
    :class:`RemoteError` naming ``url``."""
    deadline, attempt = time.monotonic() + timeout, 0
    while True:
        attempt += 1
        try:
            return call()
        except Exception as e:  # botocore/urllib3/socket errors
            backoff = BACKOFF_S * 2 ** (attempt - 1) * (1 + random.random() / 2)
            if not is_transient(e) or attempt >= max_attempts or deadline - time.monotonic() <= backoff:
                raise classify(e, url, timeout, attempt) from e
            logger.warning('%s: attempt %d of %d failed (%s); retrying in %.1f s', url, attempt,
                           max_attempts, s3_code(e) or f'{type(e).__name__}: {e}', backoff)
            time.sleep(backoff)


_local = threading.local()
#: the environment an S3 client is made from: a change makes a new one
_CLIENT_ENV = ('S3_ENDPOINT_URL', 'AWS_ACCESS_KEY_ID', 'AWS_SECRET_ACCESS_KEY', 'AWS_SESSION_TOKEN',
               'AWS_PROFILE', 'AWS_DEFAULT_REGION', 'AWS_CONFIG_FILE', 'AWS_SHARED_CREDENTIALS_FILE',
               'MOSAICML_STREAMING_AWS_REQUESTER_PAYS')


def download_client(timeout: float) -> Any:
    """This thread's download client: one ``GetObject`` per attempt (botocore's retries off), connect
    and read timeouts ``timeout``. Made again only when the environment, signing or the timeout (by
    over 0.5 s) changes: a client per shard cost more CPU than the shard's bytes."""
    key = (os.getpid(), *(os.environ.get(k) for k in _CLIENT_ENV))
    if getattr(_local, 'key', None) != key:  # a new process or environment: start afresh
        _local.key, _local.unsigned, _local.made = key, False, None
    unsigned, made = _local.unsigned, _local.made
    if made is None or made[0] != unsigned or abs(made[1] - timeout) > 0.5:
        client = make_client(max_attempts=1, connect_timeout=timeout, read_timeout=timeout, unsigned=unsigned)
        _local.made = made = (unsigned, timeout, client)
    return made[2]


def _s3_download(remote: str, local: str, timeout: float) -> None:
    """Fetch ``remote`` within the bound above, keeping streaming's S3 behaviours: requester-pays
    buckets (``MOSAICML_STREAMING_AWS_REQUESTER_PAYS``), unsigned access to public buckets when
    no credentials are configured."""
    from botocore.exceptions import ClientError, NoCredentialsError
    deadline, tried = time.monotonic() + timeout, []

    def attempt() -> None:
        # Socket timeouts of this attempt: the whole timeout for a first attempt, what is
        # left of it for a retry (so no attempt outlives the deadline).
        wanted = min(timeout, max(deadline - time.monotonic(), 0.05)) if tried else timeout
        tried.append(wanted)
        try:
            _get(download_client(wanted), remote, local)
        except (ClientError, NoCredentialsError) as e:
            if _local.unsigned or not (isinstance(e, NoCredentialsError) or s3_code(e) == '400'):
                raise
            _local.unsigned = True  # streaming's fallback for public buckets: unsigned from now on
            _get(download_client(wanted), remote, local)

    within(attempt, remote, timeout, MAX_ATTEMPTS)


def _get(client: Any, remote: str, local: str) -> None:
    obj = urllib.parse.urlparse(remote)
    payers = [b.strip() for b in os.environ.get('MOSAICML_STREAMING_AWS_REQUESTER_PAYS', '').split(',')]
    extra = {'RequestPayer': 'requester'} if obj.netloc in payers else {}
    response = client.get_object(Bucket=obj.netloc, Key=obj.path.lstrip('/'), **extra)
    with _replacing(local) as tmp, open(tmp, 'wb') as f:
        try:
            for chunk in response['Body'].iter_chunks(1 << 20):
                f.write(chunk)
        except Exception as e:  # a body cut mid-read: no hook saw this attempt fail
            if is_transient(e) and installed() is not None:
                installed().failed(failure_reason(error=e))
            raise


@contextlib.contextmanager
def _replacing(local: str) -> Iterator[str]:
    """A temporary name beside ``local``, renamed to ``local`` if the block succeeds and removed
    otherwise: no reader (or concurrent rank) sees a partial file."""
    tmp = f'{local}.part-{os.getpid()}-{random.randrange(1 << 30):x}'
    try:
        yield tmp
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def download(url: str, local: str, timeout: float) -> None:
    """Fetch ``url`` (``s3://`` or a local path) to ``local`` (its directory made), replacing it,
    within the bound above. Raises :class:`RemoteError` for every failure of the remote,
    :class:`LocalWriteError` when ``local`` may not be written."""
    try:
        path = url[len('file://'):] if url.startswith('file://') else url
        if '://' in path and not url.startswith('s3://'):
            raise ValueError(f'{url}: only s3:// URLs and local paths are remotes')
        os.makedirs(os.path.dirname(local) or '.', exist_ok=True)
        if url.startswith('s3://'):
            _s3_download(url, local, timeout)
        else:
            with _replacing(local) as tmp:
                shutil.copyfile(path, tmp)
    except Exception as e:  # boto3, botocore and OS errors
        denied = local_denied(e, local)
        if denied is not None:
            raise denied from None
        if isinstance(e, RemoteError):
            raise
        raise classify(e, url, timeout) from e
