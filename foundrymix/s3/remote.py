"""Remote files: one bounded download, and an error that says what went wrong and what to check.

Why not streaming's S3 downloader: it leaves ``connect_timeout`` at 60 s and botocore's
retries on, so an endpoint that accepts connections and never answers fails long after
``download_timeout``; and ``download_file`` first sends a HEAD request, whose error
responses have no body, so wrong credentials, a missing bucket and a missing key all read
"403"/"404" ("not found"). Here:

* :class:`BoundedS3Downloader` (foundrymix's own: streaming's ``Stream`` offers no public
  way to change its downloader) sends one ``GetObject`` per attempt, with botocore's
  retries off and ``connect_timeout = read_timeout = download_timeout``. It retries
  transient failures itself with backoff, but never starts or waits on an attempt past a
  deadline of ``download_timeout`` after the first one began. **Bound per file**: a
  download that cannot succeed fails within ``download_timeout`` plus client set-up; a
  transfer that keeps receiving bytes is not cut (the timeout bounds each stall, not a
  slow but moving shard). Retries are logged (WARNING) with the URL, attempt and cause,
  and counted (:mod:`foundrymix.s3.retries`).
* :class:`RemoteError` classifies a failure; its message names the URL, the S3 error
  code, the endpoint, and what to check.

Remotes are ``s3://`` URLs or local paths (a mounted file system): a remote path is copied.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Optional, TypeVar

from foundrymix.errors import FoundrymixError
from foundrymix.s3.retries import failure_reason, installed, watch

logger = logging.getLogger(__name__)
T = TypeVar('T')

#: attempts per file at most (each also bounded by the file's deadline)
MAX_ATTEMPTS = 5
#: first backoff between attempts, doubled each time (plus jitter)
BACKOFF_S = 0.2

_NOT_FOUND = {'NoSuchKey', '404', 'NotFound'}
_NO_BUCKET = {'NoSuchBucket'}
_CREDENTIALS = {'InvalidAccessKeyId', 'SignatureDoesNotMatch', 'ExpiredToken', 'InvalidToken',
                'TokenRefreshRequired', 'InvalidClientTokenId', 'AuthorizationHeaderMalformed',
                'RequestTimeTooSkewed'}
_DENIED = {'AccessDenied', '403', 'AllAccessDisabled', 'AccountProblem'}
_TRANSIENT = {'SlowDown', 'Throttling', 'ThrottlingException', 'RequestTimeout',
              'InternalError', 'ServiceUnavailable', 'RequestLimitExceeded', '500', '502',
              '503', '504'}


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


class BoundedS3Downloader:
    """An S3 downloader with a deadline per file; see the module docstring for the bound.

    Keeps streaming's S3 behaviours: ``S3_ENDPOINT_URL``, requester-pays buckets
    (``MOSAICML_STREAMING_AWS_REQUESTER_PAYS``), unsigned access to public buckets when no
    credentials are configured. Writes to a temporary name and renames, so a reader (or a
    concurrent rank) never sees a partial file under the final name.
    """

    def __init__(self) -> None:
        self._s3_client: Any = None
        self._requester_pays_buckets = [
            b.strip() for b in os.environ.get('MOSAICML_STREAMING_AWS_REQUESTER_PAYS', '').split(',')]

    def download(self, remote: str, local: str, timeout: float) -> None:
        """Fetch ``remote`` to ``local`` (its directory made if need be) within the bound."""
        os.makedirs(os.path.dirname(local) or '.', exist_ok=True)
        self._download_file_impl(remote, local, timeout)

    def clean_up(self) -> None:
        self._s3_client = None

    def _create_s3_client(self, unsigned: bool = False, timeout: float = 60.0) -> Any:
        from boto3.session import Session
        from botocore import UNSIGNED
        from botocore.config import Config
        kwargs: dict[str, Any] = dict(connect_timeout=timeout, read_timeout=timeout,
                                      retries={'mode': 'standard', 'total_max_attempts': 1})
        if unsigned:
            kwargs['signature_version'] = UNSIGNED
        self._unsigned = unsigned
        self._client_timeout = timeout
        self._s3_client = watch(Session().client('s3', config=Config(**kwargs),
                                                 endpoint_url=os.environ.get('S3_ENDPOINT_URL')))

    def _download_file_impl(self, remote: str, local: str, timeout: float) -> None:
        from botocore.exceptions import ClientError, NoCredentialsError
        deadline, tried = time.monotonic() + timeout, []

        def attempt() -> None:
            # Socket timeouts of this attempt: the whole timeout for a first attempt, what is
            # left of it for a retry (so no attempt outlives the deadline).
            wanted = min(timeout, max(deadline - time.monotonic(), 0.05)) if tried else timeout
            tried.append(wanted)
            if self._s3_client is None or abs(getattr(self, '_client_timeout', wanted) - wanted) > 0.5:
                self._create_s3_client(unsigned=getattr(self, '_unsigned', False), timeout=wanted)
            try:
                self._get(remote, local)
            except (ClientError, NoCredentialsError) as e:
                if getattr(self, '_unsigned', False) or not (isinstance(e, NoCredentialsError) or s3_code(e) == '400'):
                    raise
                # streaming's fallback for public buckets: try once unsigned
                self._create_s3_client(unsigned=True, timeout=wanted)
                self._get(remote, local)

        within(attempt, remote, timeout, MAX_ATTEMPTS)

    def _get(self, remote: str, local: str) -> None:
        obj = urllib.parse.urlparse(remote)
        extra = {'RequestPayer': 'requester'} if obj.netloc in self._requester_pays_buckets else {}
        response = self._s3_client.get_object(Bucket=obj.netloc, Key=obj.path.lstrip('/'), **extra)
        tmp = f'{local}.part-{os.getpid()}-{random.randrange(1 << 30):x}'
        try:
            with open(tmp, 'wb') as f:
                try:
                    for chunk in response['Body'].iter_chunks(1 << 20):
                        f.write(chunk)
                except Exception as e:  # a body cut mid-read: no hook saw this attempt fail
                    if is_transient(e) and installed() is not None:
                        installed().failed(failure_reason(error=e))
                    raise
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def within(call: Callable[[], T], url: str, timeout: float, max_attempts: int) -> T:
    """``call()`` (requests whose connect and read timeouts are at most ``timeout``, botocore's
    retries off), retried on transient failures with backoff and jitter, at most
    ``max_attempts`` times and no retry started past ``timeout`` s after the first attempt
    began: a store that never answers is named after ``timeout`` s, throttling is retried
    within it. Retries are logged (WARNING); failures raise :class:`RemoteError` naming ``url``.
    """
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


def _downloader() -> BoundedS3Downloader:
    """This thread's downloader: its S3 client (a session, credentials, a connection pool)
    is made once and reused -- a client per shard cost more CPU than the shard's bytes."""
    key = (os.getpid(), *(os.environ.get(k) for k in _CLIENT_ENV))  # what the client was made from
    if getattr(_local, 'key', None) != key:
        _local.downloader, _local.key = BoundedS3Downloader(), key
    return _local.downloader


def download(url: str, local: str, timeout: float) -> None:
    """Fetch ``url`` (``s3://`` or a local path) to ``local``, replacing it, within the bound
    above; written under a temporary name and renamed, so no reader sees a partial file.

    Raises :class:`RemoteError` for every failure of the remote, :class:`LocalWriteError`
    when ``local`` may not be written.
    """
    try:
        if url.startswith('s3://'):
            _downloader().download(url, local, timeout)
            return
        path = url[len('file://'):] if url.startswith('file://') else url
        if '://' in path:
            raise ValueError(f'{url}: only s3:// URLs and local paths are remotes')
        os.makedirs(os.path.dirname(local) or '.', exist_ok=True)
        tmp = f'{local}.part-{os.getpid()}-{random.randrange(1 << 30):x}'
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except Exception as e:  # boto3, botocore and OS errors
        denied = local_denied(e, local)
        if denied is not None:
            raise denied from None
        if isinstance(e, RemoteError):
            raise
        raise classify(e, url, timeout) from e
