"""A fault-injecting HTTP proxy on 127.0.0.1, to put between an S3 client and moto's server.

Why a proxy and not a mock: the faults a cloud job meets happen on the wire -- a 503
``SlowDown`` from S3, a connection reset mid-request, a slow answer. Injecting them in front
of a real endpoint exercises the real clients (boto3 as streaming and foundrymix use it, with
their own retry logic), so a test proves the job survives, not that a mock was called.

The proxy speaks just enough HTTP/1.1 to relay S3 traffic: keep-alive connections, bodies by
``Content-Length`` or ``chunked``, ``HEAD`` and bodiless statuses. Every request is either
forwarded, forwarded after a delay, answered with ``503 SlowDown`` (an S3 XML error body), or
cut with a TCP reset. Faults are drawn from a seeded generator, and one request (method and
path) is never faulted more than ``max_faults_per_request`` times in a row, so a client with
a few retries always gets through: the outcome of a test does not depend on luck, only the
number of retries does. :attr:`FaultProxy.counts` says what was injected.

Usage::

    with moto_s3('bkt') as s3, FaultProxy(s3['endpoint'], error_rate=0.1) as proxy:
        os.environ['S3_ENDPOINT_URL'] = proxy.endpoint
        ...
        assert proxy.counts['503'] > 0
"""

from __future__ import annotations

import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from typing import Callable, Optional
from urllib.parse import urlparse

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message><RequestId>fault-proxy'
             b'</RequestId></Error>')


class _Closed(Exception):
    """The peer closed the connection between requests."""


def _read_line(sock_file) -> bytes:
    line = sock_file.readline(65537)
    if not line:
        raise _Closed()
    return line


def _read_head(sock_file) -> tuple[bytes, dict[str, str]]:
    """The start line and header block (raw bytes), and the headers (lower-cased names)."""
    raw = _read_line(sock_file)
    while raw in (b'\r\n', b'\n'):  # tolerate stray blank lines between requests
        raw = _read_line(sock_file)
    headers: dict[str, str] = {}
    while True:
        line = _read_line(sock_file)
        raw += line
        if line in (b'\r\n', b'\n'):
            return raw, headers
        name, _, value = line.decode('latin-1').partition(':')
        headers[name.strip().lower()] = value.strip()


def _read_body(sock_file, headers: dict[str, str], until_close: bool = False) -> bytes:
    """The message body exactly as sent (chunked bodies stay chunked)."""
    if 'chunked' in headers.get('transfer-encoding', '').lower():
        out = b''
        while True:
            size_line = _read_line(sock_file)
            out += size_line
            size = int(size_line.split(b';')[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = _read_line(sock_file)
                    out += line
                    if line in (b'\r\n', b'\n'):
                        return out
            out += sock_file.read(size + 2)
    if 'content-length' in headers:
        return sock_file.read(int(headers['content-length']))
    return sock_file.read() if until_close else b''


class FaultProxy:
    """Relays HTTP between clients and ``upstream``, injecting 503s, resets and delays.

    Args:
        upstream: the real endpoint, e.g. ``http://127.0.0.1:PORT`` (moto's server).
        error_rate: share of requests answered ``503 SlowDown`` (not forwarded).
        reset_rate: share of requests whose connection is reset (TCP RST) before any answer.
        delay_rate: share of requests forwarded after ``delay_s`` seconds.
        seed: seed of the fault draws.
        max_faults_per_request: at most this many faults in a row for one (method, path);
            the next attempt is forwarded, so clients with that many retries always succeed.
        should_fault: optional ``(method, path) -> bool``; requests it rejects are never
            faulted (e.g. fault only shard GETs).
        hold: optional ``(method, path) -> bool``; a request it accepts is read whole and never
            answered (held open until the proxy stops: an upload in flight), and :attr:`held`
            is set.
    """

    def __init__(self, upstream: str, *, error_rate: float = 0.0, reset_rate: float = 0.0,
                 delay_rate: float = 0.0, delay_s: float = 0.2, seed: int = 0,
                 max_faults_per_request: int = 1,
                 should_fault: Optional[Callable[[str, str], bool]] = None,
                 hold: Optional[Callable[[str, str], bool]] = None) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or '127.0.0.1', parsed.port or 80)
        self.error_rate, self.reset_rate, self.delay_rate = error_rate, reset_rate, delay_rate
        self.delay_s = delay_s
        self.max_faults = max_faults_per_request
        self.should_fault = should_fault
        self.hold = hold
        self.held = threading.Event()
        self._stopped = threading.Event()
        self.counts: Counter = Counter()
        self.log: list[tuple[str, str, str]] = []  # (method, path, what happened)
        self._rng = random.Random(seed)
        self._streak: Counter = Counter()
        self._lock = threading.Lock()
        self._server: Optional[socketserver.ThreadingTCPServer] = None
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        assert self._server is not None, 'start the proxy first'
        host, port = self._server.server_address[:2]
        return f'http://{host}:{port}'

    def start(self) -> 'FaultProxy':
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(('127.0.0.1', 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()  # releases held requests (their connections close)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> 'FaultProxy':
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults
    def _decide(self, method: str, path: str) -> str:
        key = (method, path)
        with self._lock:
            self.counts['requests'] += 1
            draw = self._rng.random()
            if self.hold is not None and self.hold(method, path):
                self.counts['hold'] += 1
                self.log.append((method, path, 'hold'))
                self.held.set()
                return 'hold'
            if self.should_fault is not None and not self.should_fault(method, path):
                what = 'forward'
            elif self._streak[key] >= self.max_faults:
                what = 'forward'
            elif draw < self.error_rate:
                what = '503'
            elif draw < self.error_rate + self.reset_rate:
                what = 'reset'
            elif draw < self.error_rate + self.reset_rate + self.delay_rate:
                what = 'delay'
            else:
                what = 'forward'
            if what in ('503', 'reset'):
                self._streak[key] += 1
            else:
                self._streak.pop(key, None)
            self.counts[what] += 1
            self.log.append((method, path, what))
            return what

    # ------------------------------------------------------------------ relay
    def _serve(self, client: socket.socket) -> None:
        client_file = client.makefile('rb')
        upstream: Optional[socket.socket] = None
        upstream_file = None
        try:
            while True:
                try:
                    head, headers = _read_head(client_file)
                except (_Closed, ConnectionError, OSError):
                    return
                if headers.get('expect', '').lower() == '100-continue':
                    # Answer for the upstream (and drop the header): the client sends its
                    # body at once instead of waiting for botocore's 1 s expect timeout.
                    client.sendall(b'HTTP/1.1 100 Continue\r\n\r\n')
                    head = b''.join(line + b'\r\n' for line in head.split(b'\r\n')
                                    if line and not line.lower().startswith(b'expect:')) + b'\r\n'
                body = _read_body(client_file, headers)
                method, path = head.split(b' ', 2)[:2]
                method_s, path_s = method.decode(), path.decode('latin-1')
                what = self._decide(method_s, path_s)
                if what == 'hold':
                    self._stopped.wait()
                    return
                if what == 'reset':
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
                    client.close()
                    return
                if what == '503':
                    client.sendall(b'HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n'
                                   b'Content-Length: %d\r\nx-amz-request-id: fault-proxy\r\n\r\n'
                                   % len(_SLOWDOWN) + _SLOWDOWN)
                    continue
                if what == 'delay':
                    time.sleep(self.delay_s)
                for attempt in (0, 1):  # a kept-alive upstream connection may have closed
                    if upstream is None:
                        upstream = socket.create_connection(self.upstream)
                        upstream_file = upstream.makefile('rb')
                    try:
                        upstream.sendall(head + body)
                        status_head, status_headers = _read_head(upstream_file)
                        while status_head.split(b' ', 2)[1].startswith(b'1'):  # interim
                            status_head, status_headers = _read_head(upstream_file)
                        break
                    except (_Closed, ConnectionError):
                        upstream_file.close()
                        upstream.close()
                        upstream = upstream_file = None
                        if attempt:
                            raise
                status = int(status_head.split(b' ', 2)[1])
                closes = status_headers.get('connection', '').lower() == 'close'
                if method == b'HEAD' or status in (204, 304):
                    reply = b''
                else:
                    reply = _read_body(upstream_file, status_headers, until_close=closes)
                client.sendall(status_head + reply)
                if closes:
                    return
        except (_Closed, ConnectionError, OSError):
            return
        finally:
            for f in (client_file, upstream_file):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
            for s in (client, upstream):
                try:
                    if s is not None:
                        s.close()
                except OSError:
                    pass
