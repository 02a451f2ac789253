"""Count the S3 requests and retries that really happened, for one line in the training log.

Why: botocore retries 503 ``SlowDown`` replies, connection resets and timeouts silently, so
a job that spends much of its time retrying looks like a slow job. The clients are created
in many places (per downloader, per thread and per DataLoader worker, inside the trainer's
checkpoint uploader), so no handler can be registered on them; what every one of them does is
log at DEBUG level through fixed loggers:

* ``botocore.endpoint``: ``Making request for ...`` once per API call, ``Sending http
  request`` once per attempt;
* ``botocore.retries.standard`` (standard and adaptive modes) ``Retry needed, retrying
  request after delay ...`` and ``botocore.retryhandler`` (legacy mode) ``Retry needed,
  action of ...``: one per retry; the reason (HTTP status and S3 error code, or the
  exception) is read from botocore's ``Endpoint._needs_retry`` frame that emitted it;
* ``foundrymix.s3.remote``: the bounded S3 downloader retries by itself (botocore's retries
  are off there) and tags each retry record with its reason (``s3_retry``).

:func:`install` puts a counting *filter* on those loggers (and lowers them to DEBUG) that
drops the DEBUG records the user's logging setup would not have shown, so nothing new is
printed. The counts live in shared memory (a ``RawArray``), so DataLoader workers forked
after :func:`install` and the checkpoint upload threads add to the same counters;
*spawned* processes (the trainer's own uploader, which sharded checkpoints keep) are not counted.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

#: the counters, in order (indices into the shared array)
FIELDS = ('requests', 'attempts', 'retries', 'slowdown', 'http_other', 'reset', 'timeout',
          'connect', 'other')

#: how each retry reason is written in the summary line
REASON_LABELS = {'slowdown': '503 SlowDown', 'http_other': 'other HTTP error',
                 'reset': 'connection reset', 'timeout': 'timeout', 'connect': 'connect failed',
                 'other': 'other'}

_LOGGERS = ('botocore.endpoint', 'botocore.retries.standard', 'botocore.retryhandler',
            'foundrymix.s3.remote')


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

    def line(self, what: str = 'S3') -> str:
        """``S3: 812 requests, 37 retries (503 SlowDown 21, connection reset 12, timeout 4)``."""
        c = self.counts
        text = f"{what}: {c['requests']} requests, {c['retries']} retries"
        reasons = [f'{label} {c[key]}' for key, label in REASON_LABELS.items() if c[key]]
        if reasons:
            text += f" ({', '.join(reasons)})"
        return text


def _reason(frame: Any) -> str:
    """Why botocore retries: read from the ``Endpoint._needs_retry`` frame up the stack."""
    for _ in range(30):
        if frame is None:
            break
        if frame.f_code.co_name == '_needs_retry' and 'caught_exception' in frame.f_locals:
            exc = frame.f_locals.get('caught_exception')
            response = frame.f_locals.get('response')
            if exc is not None:
                name = type(exc).__name__
                if 'Timeout' in name:
                    return 'timeout'
                if 'EndpointConnection' in name or 'ConnectTimeout' in name:
                    return 'connect'
                if 'Closed' in name or 'Reset' in name or 'Protocol' in name or 'Connection' in name:
                    return 'reset'
                return 'other'
            if response is not None:
                http, parsed = response
                code = (parsed or {}).get('Error', {}).get('Code') if isinstance(parsed, dict) else None
                if getattr(http, 'status_code', None) == 503 or code == 'SlowDown':
                    return 'slowdown'
                return 'http_other'
            return 'other'
        frame = frame.f_back
    return 'other'


class _CountingFilter(logging.Filter):
    """Counts the records named in the module docstring; drops DEBUG records the user's
    logging setup would not have shown (``show_level``: the logger's level before)."""

    def __init__(self, counter: 'S3RetryCounter', show_level: int) -> None:
        super().__init__()
        self.counter = counter
        self.show_level = show_level

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ''
        if msg.startswith('Making request for'):
            self.counter._add('requests')
        elif msg.startswith('Sending http request'):
            self.counter._add('attempts')
        elif msg.startswith('Retry needed, retrying request') or msg.startswith('Retry needed, action of'):
            self.counter._add('retries', _reason(sys._getframe(1)))
        elif hasattr(record, 's3_retry'):
            # foundrymix.s3.remote's BoundedS3Downloader retries by itself (botocore's retries are
            # off there): each attempt is a new API call, so the retry is not a new request.
            self.counter._add('retries', record.s3_retry, requests=-1)
        return record.levelno >= self.show_level


class S3RetryCounter:
    """The installed counters; one per process tree (see :func:`install`)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context('fork') if sys.platform != 'win32' else multiprocessing
        self._values = ctx.RawArray('q', len(FIELDS))
        self._lock = ctx.Lock()
        self._filters: list[tuple[logging.Logger, _CountingFilter, int]] = []

    def _add(self, name: str, reason: Optional[str] = None, requests: int = 0) -> None:
        with self._lock:
            self._values[FIELDS.index(name)] += 1
            if reason is not None:
                self._values[FIELDS.index(reason)] += 1
            self._values[FIELDS.index('requests')] += requests

    def snapshot(self) -> RetryCounts:
        with self._lock:
            return RetryCounts(dict(zip(FIELDS, self._values[:])))

    def _attach(self) -> None:
        for name in _LOGGERS:
            logger = logging.getLogger(name)
            flt = _CountingFilter(self, logger.getEffectiveLevel())
            self._filters.append((logger, flt, logger.level))
            logger.addFilter(flt)
            logger.setLevel(logging.DEBUG)

    def uninstall(self) -> None:
        """Take the filters off and give the loggers their levels back."""
        global _INSTALLED
        for logger, flt, level in self._filters:
            logger.removeFilter(flt)
            logger.setLevel(level)
        self._filters.clear()
        if _INSTALLED is self:
            _INSTALLED = None


_INSTALLED: Optional[S3RetryCounter] = None


def install() -> S3RetryCounter:
    """Start counting in this process (and in processes forked from it later); idempotent."""
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = S3RetryCounter()
        _INSTALLED._attach()
    return _INSTALLED


def installed() -> Optional[S3RetryCounter]:
    return _INSTALLED
