"""Every S3 client foundrymix makes: botocore's ``standard`` retries (backoff with jitter on
throttling, 5xx, resets and timeouts), bounded timeouts, attempts and failed attempts counted by
reason (:mod:`foundrymix.s3.retries`); errors described by URL, S3 error code and what to check.

Credentials and endpoint are boto3's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``~/.aws``, instance roles) and ``S3_ENDPOINT_URL`` for S3-compatible stores;
``AWS_MAX_ATTEMPTS`` sets the attempts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from foundrymix.s3.retries import S3RetryCounter, watch

#: attempts per request unless ``AWS_MAX_ATTEMPTS`` says otherwise
DEFAULT_ATTEMPTS = 8


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


def hint(code: str) -> str:
    if code in ('NoSuchBucket', '404', 'NotFound'):
        return 'check the bucket name and the endpoint (S3_ENDPOINT_URL)'
    if code in ('InvalidAccessKeyId', 'SignatureDoesNotMatch', 'AccessDenied', '403', 'Forbidden',
                'NoCredentialsError', 'PartialCredentialsError', 'ExpiredToken'):
        return ('check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) '
                'and that they may list, read, write and delete under this prefix')
    return 'check that the endpoint is up and reachable (S3_ENDPOINT_URL, network, proxy settings)'


def describe(action: str, url: str, error: BaseException) -> str:
    """One message naming the URL, what was attempted, S3's error code and what to check."""
    code = s3_code(error) or type(error).__name__
    return f'{url}: {action} failed ({code}: {error}); {hint(code)}'


def make_client(retries: Optional[S3RetryCounter] = None, max_attempts: Optional[int] = None,
                connect_timeout: float = 10, read_timeout: float = 30, threads: int = 4, unsigned: bool = False) -> Any:
    """A boto3 S3 client with standard retries and bounded timeouts, whose attempts and retries
    go to ``retries`` (default: the process's installed counter, :func:`foundrymix.s3.retries.watch`).

    An endpoint that stops answering fails a request after ``max_attempts`` x
    ``read_timeout`` plus backoff (at most 20 s between attempts). ``unsigned``: anonymous requests
    (a public bucket without credentials).
    """
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
