"""Count the S3 requests and retries foundrymix's own clients make, by reason, for one log line.

Why: botocore retries 503 ``SlowDown`` replies, connection resets and timeouts silently, so
a job that spends much of its time retrying looks like a slow job.

How: :func:`watch` registers two handlers on a client's public event hooks: ``before-send.s3``
counts every HTTP request put on the wire (an *attempt*), ``needs-retry.s3`` (emitted after every
attempt) counts one that failed with a 5xx/429 answer or an exception, by reason. Every client
foundrymix makes is watched (:func:`foundrymix.s3.remote.make_client`); no logger is touched.

Guarantees: ``attempts`` is the number of HTTP requests sent; ``retries`` the failed attempts (a
request's last one included); ``requests = attempts - retries``. The counters live in shared
memory, so DataLoader workers forked after :func:`install` add to the same counts.
"""

from __future__ import annotations

import multiprocessing
import socket
from dataclasses import dataclass, field
from typing import Any, Optional

#: the counters, in order; ``requests`` is derived (attempts - retries)
FIELDS = ('requests', 'attempts', 'retries', 'slowdown', 'http_other', 'reset', 'timeout',
          'connect', 'other')
_STORED = FIELDS[1:]

#: how each retry reason is written in the summary line
REASON_LABELS = {'slowdown': '503 SlowDown', 'http_other': 'other HTTP error',
                 'reset': 'connection reset', 'timeout': 'timeout', 'connect': 'connect failed',
                 'other': 'other'}


@dataclass
class RetryCounts:
    """A snapshot of the counters (summed over the processes that share them)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIELDS, 0))

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def __sub__(self, other: 'RetryCounts') -> 'RetryCounts':
        return RetryCounts({k: self.counts[k] - other.counts[k] for k in FIELDS})

    def __add__(self, other: 'RetryCounts') -> 'RetryCounts':
        return RetryCounts({k: self.counts[k] + other.counts[k] for k in FIELDS})

    def summary(self) -> str:
        """``37 retries (503 SlowDown 21, connection reset 12, timeout 4)`` or ``no retries``."""
        c = self.counts
        if not c['retries']:
            return 'no retries'
        reasons = [f'{label} {c[key]}' for key, label in REASON_LABELS.items() if c[key]]
        return f"{c['retries']} retries ({', '.join(reasons)})"

    def line(self, what: str = 'S3') -> str:
        """``S3: 812 requests, 37 retries (503 SlowDown 21, connection reset 12, timeout 4)``."""
        retries = self.summary() if self.counts['retries'] else '0 retries'
        return f"{what}: {self.counts['requests']} requests, {retries}"


def failure_reason(response: Any = None, error: Optional[BaseException] = None) -> Optional[str]:
    """Why an attempt failed (a key of :data:`REASON_LABELS`), or None when it did not fail in
    a way worth another attempt (an answer below 500 other than 429)."""
    if error is not None:
        name = type(error).__name__
        if 'EndpointConnection' in name or 'ConnectTimeout' in name:
            return 'connect'
        if 'Timeout' in name or isinstance(error, (socket.timeout, TimeoutError)):
            return 'timeout'
        if any(w in name for w in ('Closed', 'Reset', 'Protocol', 'Connection', 'IncompleteRead',
                                   'ResponseStreaming')):
            return 'reset'
        return 'other'
    if response is None:
        return None
    http, parsed = response
    status = getattr(http, 'status_code', 0)
    code = (parsed or {}).get('Error', {}).get('Code') if isinstance(parsed, dict) else None
    if status == 503 or code == 'SlowDown':
        return 'slowdown'
    if status >= 500 or status == 429:
        return 'http_other'
    return None


class S3RetryCounter:
    """Counters shared by this process and the processes forked from it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context('fork')  # foundrymix is POSIX-only (flock)
        self._values = ctx.RawArray('q', len(_STORED))
        self._lock = ctx.Lock()

    def _add(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._values[_STORED.index(name)] += 1

    def failed(self, reason: str) -> None:
        """An attempt failed where no ``needs-retry`` event saw it (a body cut mid-read)."""
        self._add('retries', reason)

    def snapshot(self) -> RetryCounts:
        with self._lock:
            counts = dict(zip(_STORED, self._values[:]))
        return RetryCounts({'requests': counts['attempts'] - counts['retries'], **counts})

    def summary(self) -> str:
        return self.snapshot().summary()


_INSTALLED: Optional[S3RetryCounter] = None


def install() -> S3RetryCounter:
    """The process's counter, made on the first call (before DataLoader workers fork)."""
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = S3RetryCounter()
    return _INSTALLED


def installed() -> Optional[S3RetryCounter]:
    return _INSTALLED


def watch(client: Any, counter: Optional[S3RetryCounter] = None) -> Any:
    """Count ``client``'s attempts and failed attempts into ``counter`` (default: the installed
    counter at the time of each request, nothing while none is installed); returns ``client``."""

    def target() -> Optional[S3RetryCounter]:
        return counter if counter is not None else _INSTALLED

    def sent(**_: Any) -> None:
        c = target()
        if c is not None:
            c._add('attempts')

    def outcome(response: Any = None, caught_exception: Optional[BaseException] = None,
                **_: Any) -> None:
        reason = failure_reason(response, caught_exception)
        c = target()
        if reason is not None and c is not None:
            c._add('retries', reason)
        return None  # never decides whether to retry: botocore's own handler does

    client.meta.events.register('before-send.s3', sent)
    client.meta.events.register('needs-retry.s3', outcome)
    return client
