"""S3 request and retry counts (``foundrymix.s3.retries``) against what the fault proxy saw.

The independent source is the proxy in front of moto's server: it counts every HTTP request
that reached it and every 503 and reset it injected. The counters must equal those counts
exactly, for both kinds of foundrymix client -- the shard downloader (botocore's retries off,
its own retries) and the upload/listing client (botocore's standard retries) -- and for a
forked process (a DataLoader worker). No logger may be changed by counting.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

import pytest

from fault_proxy import FaultProxy
from foundrymix.s3 import remote, retries
from foundrymix.s3.remote import make_client
from helpers import moto_s3

BUCKET = 'fmx-counts'
N = 24


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        blobs = {f'obj/{i:02d}': os.urandom(1000 + 37 * i) for i in range(N)}
        for key, blob in blobs.items():
            server['client'].put_object(Bucket=BUCKET, Key=key, Body=blob)
        server['blobs'] = blobs
        yield server


def _loggers() -> dict[str, tuple[int, list]]:
    names = ['', 'botocore', 'botocore.endpoint', 'botocore.retries.standard', 'botocore.retryhandler',
             'foundrymix.s3.remote']
    return {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}


def _download_all(tmp, blobs) -> None:
    for key, blob in blobs.items():
        local = os.path.join(tmp, key)
        remote.download(f's3://{BUCKET}/{key}', local, timeout=20)
        with open(local, 'rb') as f:
            assert f.read() == blob


def test_downloader_counts_equal_the_proxy(tmp_path, s3, monkeypatch):
    loggers = _loggers()
    counter = retries.install()
    with FaultProxy(s3['endpoint'], error_rate=0.3, reset_rate=0.2, delay_rate=0.1, delay_s=0.02,
                    seed=7) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        before = counter.snapshot()
        _download_all(str(tmp_path), s3['blobs'])
        got = counter.snapshot() - before
    assert proxy.counts['503'] > 0 and proxy.counts['reset'] > 0
    assert got['attempts'] == proxy.counts['requests']
    assert got['slowdown'] == proxy.counts['503'] and got['reset'] == proxy.counts['reset']
    assert got['retries'] == proxy.counts['503'] + proxy.counts['reset']
    assert got['requests'] == N  # one GetObject per file, however many attempts it took
    assert got.line() == (f"S3: {N} requests, {got['retries']} retries (503 SlowDown "
                          f"{proxy.counts['503']}, connection reset {proxy.counts['reset']})")
    assert _loggers() == loggers


def test_client_with_botocore_retries_counts_equal_the_proxy(s3, monkeypatch):
    loggers = _loggers()
    counter = retries.S3RetryCounter()
    with FaultProxy(s3['endpoint'], error_rate=0.3, reset_rate=0.2, seed=2,
                    max_faults_per_request=2) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        client = make_client(counter)
        keys = sorted(o['Key'] for o in client.list_objects_v2(Bucket=BUCKET)['Contents'])
        assert keys == sorted(s3['blobs'])
        for key in keys:
            assert client.get_object(Bucket=BUCKET, Key=key)['Body'].read() == s3['blobs'][key]
        got = counter.snapshot()
    assert proxy.counts['503'] > 0 and proxy.counts['reset'] > 0
    assert got['attempts'] == proxy.counts['requests']
    assert got['slowdown'] == proxy.counts['503'] and got['reset'] == proxy.counts['reset']
    assert got['retries'] == proxy.counts['503'] + proxy.counts['reset']
    assert got['requests'] == N + 1
    assert counter.summary().startswith(f"{got['retries']} retries (503 SlowDown {proxy.counts['503']}")
    assert _loggers() == loggers


def _child(tmp: str, blobs: dict) -> None:
    _download_all(tmp, blobs)


def test_a_forked_process_adds_to_the_same_counts(tmp_path, s3, monkeypatch):
    counter = retries.install()
    with FaultProxy(s3['endpoint'], error_rate=0.3, seed=4) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        before = counter.snapshot()
        child = multiprocessing.get_context('fork').Process(target=_child, args=(str(tmp_path), s3['blobs']))
        child.start()
        child.join(120)
        got = counter.snapshot() - before
    assert child.exitcode == 0
    assert proxy.counts['503'] > 0
    assert got['attempts'] == proxy.counts['requests'] and got['slowdown'] == proxy.counts['503']
    assert got['requests'] == N


def test_a_run_without_faults_has_no_retries(tmp_path, s3, monkeypatch):
    counter = retries.install()
    before = counter.snapshot()
    _download_all(str(tmp_path), s3['blobs'])
    got = counter.snapshot() - before
    assert got['requests'] == got['attempts'] == N and got['retries'] == 0
    assert got.line() == f'S3: {N} requests, 0 retries'
