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

#: what ``setpriv`` drops so that root obeys file modes like any user
NO_DAC = ['setpriv', '--bounding-set', '-dac_override,-dac_read_search']

#: LLM-Foundry's own YAMLs (tests/data/foundry/README.md: source, commit and license)
FOUNDRY_DIR = ROOT / 'tests' / 'data' / 'foundry'


def reference_decode(row) -> dict[str, list[int]]:
    """A stored row's model inputs by the schema's meaning, one token at a time (an oracle
    independent of ``decode_row``; ``-100`` is the ignored label)."""
    ids = [int(x) for x in row['input_ids']]
    spans = row['loss_spans'].reshape(-1, 2).tolist()
    out = {'input_ids': ids, 'labels': [], 'attention_mask': [], 'sequence_id': [], 'position_ids': []}
    owner = []
    for seg, length in enumerate(row['doc_lens'].tolist()):
        owner += [(seg, pos) for pos in range(length)]
    for i, tok in enumerate(ids):
        in_loss = any(s <= i < e for s, e in spans)
        out['labels'].append(tok if in_loss else -100)
        real = i < len(owner)
        out['attention_mask'].append(1 if real else 0)
        out['sequence_id'].append(owner[i][0] if real else -1)
        out['position_ids'].append(owner[i][1] if real else 0)
    return out


class LoggedTokens:
    """Sample-log ``tokens`` digests recomputed independently: each logged sample's stored row
    as streaming itself reads it (``StreamingDataset`` over the stream's directory; a global
    sample id counts the streams' rows end to end, in the YAML's order), decoded by
    :func:`reference_decode`, hashed as the ``sample_log`` callback documents (``xxh3_64`` of
    each row's five model inputs as ``int64``, then of the row digests sorted: the digest of a
    global batch does not depend on its rows' order, which depends on the number of ranks)."""

    KEYS = ('input_ids', 'labels', 'attention_mask', 'sequence_id', 'position_ids')

    def __init__(self, directories: list[str]) -> None:
        from streaming import StreamingDataset
        self.datasets = [StreamingDataset(local=d, shuffle=False, batch_size=1) for d in directories]
        self.starts = [sum(len(d) for d in self.datasets[:i]) for i in range(len(self.datasets))]

    def digest(self, sample_ids: list[int], stream_ids: list[int]) -> str:
        import numpy as np
        import xxhash
        rows = []
        for sample, stream in zip(sample_ids, stream_ids):
            start = self.starts[stream]
            assert start <= sample < start + len(self.datasets[stream]), (sample, stream)
            decoded = reference_decode(self.datasets[stream][sample - start])
            rows.append(xxhash.xxh3_64_hexdigest(np.array([decoded[k] for k in self.KEYS], np.int64).tobytes()))
        return xxhash.xxh3_64_hexdigest(''.join(sorted(rows)).encode())


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


@contextlib.contextmanager
def silent_server(accepted: list | None = None):
    """An endpoint that accepts TCP connections and never answers (a hung store or proxy):
    yields its URL. Connections are held open until the context exits; each one accepted is
    appended to ``accepted`` (when given), so a test can count the client's attempts."""
    import socket
    import threading

    server = socket.socket()
    server.bind(('127.0.0.1', 0))
    server.listen(64)
    server.settimeout(0.1)
    held: list = [] if accepted is None else accepted
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except socket.timeout:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.getsockname()[1]}'
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@contextlib.contextmanager
def s3_requests():
    """The requests every moto server of this process answers while inside, as
    ``'GET /bucket/key'`` strings (from werkzeug's request log; error answers too)."""
    import logging
    import re

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = re.sub(r'\x1b\[[0-9;]*m', '', record.getMessage())  # werkzeug colours errors
            if '"' in text:
                method, path = text.split('"')[1].split()[:2]
                lines.append(f'{method} {path.split("?")[0]}')

    log = logging.getLogger('werkzeug')
    level, handler = log.level, Collect()
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@contextlib.contextmanager
def moto_auth(endpoint: str):
    """Make the moto server at ``endpoint`` check credentials (it accepts any by default).

    Creates an IAM user with an access key and no policy, then switches moto's request
    authentication on (``/moto-api/reset-auth`` to 0, the server side of
    ``moto.core.set_initial_no_auth_action_count(0)``): an unknown key id then gets
    ``InvalidAccessKeyId``, the user's key id with a wrong secret ``SignatureDoesNotMatch``,
    and the user's own credentials ``AccessDenied``. Yields {key_id, secret}; switched off
    again on exit (the setting is global to moto in this process).
    """
    import boto3
    import requests

    iam = boto3.client('iam', endpoint_url=endpoint)
    iam.create_user(UserName='no-policy')
    key = iam.create_access_key(UserName='no-policy')['AccessKey']
    requests.post(f'{endpoint}/moto-api/reset-auth', data=b'0', timeout=10).raise_for_status()
    try:
        yield {'key_id': key['AccessKeyId'], 'secret': key['SecretAccessKey']}
    finally:
        requests.post(f'{endpoint}/moto-api/reset-auth', data=b'inf', timeout=10).raise_for_status()


def build_staged_loader(config, batch_size: int, max_duration=None, topology=None,
                        where: str = 'train_loader'):
    """Validate every stage, plan the run, and return its loader (``loader.run`` is the plan)."""
    from foundrymix.loader.run_loader import build_run_loader

    return build_run_loader(config, batch_size, max_duration, topology, where=where)[0]


def staged(streams) -> dict:
    """A data-only config: two stages over the two small streams, 4 rows a batch."""
    return {
        'global_train_batch_size': 4,
        'train_loader': {
            'streams': {n: {'local': str(p)} for n, p in streams.items()},
            'shuffle_seed': 3,
            'stages': [{'name': 'text', 'duration': '5ba', 'streams': {'arxiv': {'repeat': 1}}},
                       {'name': 'mix', 'duration': '9ba',
                        'streams': {'arxiv': {'repeat': 0.5}, 'dolly': {'repeat': 1}}}]}}


def tiny_dbrx(path: Path) -> Path:
    """A 1-layer DBRX (2 experts) saved by transformers itself, the bundled tokenizer beside it."""
    import torch
    from transformers import DbrxConfig, DbrxForCausalLM

    from foundrymix.tokenizer import load_tokenizer
    torch.manual_seed(0)
    DbrxForCausalLM(DbrxConfig(d_model=16, n_heads=2, n_layers=1, max_seq_len=SMALL_SEQ, vocab_size=8192,
                               attn_config={'kv_n_heads': 2, 'rope_theta': 1e4, 'clip_qkv': 8.0},  # 5.24 needs both
                               ffn_config={'ffn_hidden_size': 32, 'moe_num_experts': 2, 'moe_top_k': 1})
                    ).save_pretrained(path)
    load_tokenizer(DEMO_TOKENIZER).save_pretrained(path)
    return path


def mode_prefix():
    """How to run a command that must obey file modes: as is (not root), under ``setpriv``
    without root's file-access capabilities, or ``None`` (not possible here)."""
    import os
    import shutil
    import subprocess
    import tempfile
    if os.geteuid() != 0:
        return []
    if shutil.which('setpriv') is None:
        return None
    with tempfile.NamedTemporaryFile() as f:
        os.chmod(f.name, 0)
        probe = subprocess.run([*NO_DAC, 'test', '-r', f.name], capture_output=True)
    return NO_DAC if probe.returncode == 1 else None
