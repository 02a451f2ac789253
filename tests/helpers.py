"""Plain helpers shared by test modules (import them: ``from helpers import ...``).

Fixtures stay in ``conftest.py``; this module holds the constants and functions tests
import directly.
"""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / 'data' / 'samples'

#: bundled byte-level BPE (GPT-2 style: no BOS, EOS ``<|endoftext|>``, ChatML template)
DEMO_TOKENIZER = 'foundrymix-bpe-8k'

#: rows of the ``small_streams`` fixture (tokens per row)
SMALL_SEQ = 128


def spm_tokenizer_path() -> str:
    """Mistral's Llama-style SentencePiece model shipped inside ``mistral-common`` (adds BOS)."""
    return str(resources.files('mistral_common') / 'data' / 'tokenizer.model.v1')


def tiny_run_config(train_loader: dict, **top) -> dict:
    """A training config for a tiny Llama on ``SMALL_SEQ`` rows; ``top`` overrides any key."""
    cfg = {
        'seed': 5,
        'max_seq_len': SMALL_SEQ,
        'model': {'type': 'llama', 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 1,
                  'num_attention_heads': 2, 'num_key_value_heads': 2, 'max_position_embeddings': SMALL_SEQ},
        'train_loader': train_loader,
        'optimizer': {'lr': 0.01},
        'save_interval': '1000ba',
        'loggers': {},
    }
    cfg.update(top)
    return cfg


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3(bucket: str):
    """A real S3 HTTP endpoint (moto's server) on 127.0.0.1 with ``bucket`` created, and the
    environment streaming/boto3 read pointed at it: yields endpoint, env and a boto3 client."""
    import logging

    import boto3
    import pytest
    from moto.server import ThreadedMotoServer

    logging.getLogger('werkzeug').setLevel(logging.ERROR)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address='127.0.0.1', port=port, verbose=False)
    server.start()
    endpoint = f'http://127.0.0.1:{port}'
    env = {'S3_ENDPOINT_URL': endpoint, 'AWS_ACCESS_KEY_ID': 'testing',
           'AWS_SECRET_ACCESS_KEY': 'testing', 'AWS_DEFAULT_REGION': 'us-east-1'}
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    for key in ('AWS_SESSION_TOKEN', 'AWS_PROFILE', 'MOSAICML_STREAMING_AWS_REQUESTER_PAYS'):
        mp.delenv(key, raising=False)
    try:
        client = boto3.client('s3', endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        yield {'endpoint': endpoint, 'env': env, 'client': client}
    finally:
        mp.undo()
        server.stop()
