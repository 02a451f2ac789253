"""The fault proxy the S3 fault tests rely on: it injects what it says and relays bytes exactly."""

import os

import boto3
from botocore.config import Config

from fault_proxy import FaultProxy
from helpers import moto_s3


def test_proxy_injects_faults_and_relays_bytes_exactly():
    with moto_s3('bkt') as s3, FaultProxy(s3['endpoint'], error_rate=0.2, reset_rate=0.1,
                                          delay_rate=0.1, delay_s=0.01, seed=3) as proxy:
        client = boto3.client('s3', endpoint_url=proxy.endpoint,
                              config=Config(retries={'max_attempts': 3, 'mode': 'standard'}))
        blobs = {f'k{i}': os.urandom(997 * i + 1) for i in range(30)}
        for key, blob in blobs.items():
            client.put_object(Bucket='bkt', Key=key, Body=blob)
        for key, blob in blobs.items():
            assert client.get_object(Bucket='bkt', Key=key)['Body'].read() == blob
            assert client.head_object(Bucket='bkt', Key=key)['ContentLength'] == len(blob)
        counts = proxy.counts
        assert counts['503'] > 0 and counts['reset'] > 0 and counts['delay'] > 0
        assert counts['requests'] == sum(counts[k] for k in ('503', 'reset', 'delay', 'forward'))
        # Every fault was followed by a successful attempt of the same request.
        assert counts['forward'] + counts['delay'] >= 90
