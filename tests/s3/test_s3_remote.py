"""Remote streams when the remote changes or fails (moto's S3 server on 127.0.0.1, no mocks).

Checked: a dataset re-uploaded to the same prefix after the cache was filled is detected
on the next start -- foundrymix's own cache is refreshed (rows read are the new
dataset's, bitwise) and a ``local:`` directory the user named is refused, untouched;
permanent errors (wrong credentials, missing bucket, a hung or absent endpoint) name the
URL, the S3 error code and what to check, after a bounded number of attempts (counted: the
requests moto answered, the connections a hung endpoint accepted, the retries logged -- never
the wall clock, so the checks hold on a loaded machine); ``plan`` and ``inspect s3://`` fetch
only metadata.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from foundrymix.cli import main
from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from foundrymix.s3.remote import download_client
import mix_helpers
from helpers import ROOT, free_port, moto_auth, moto_s3, s3_requests, silent_server, tiny_run_config

BUCKET = 'fmx-remote'
BATCH = 4
METADATA = {'foundrymix.json', 'index.json'}


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


def upload(s3, directory: Path, prefix: str) -> str:
    """Replace everything under ``prefix`` with the files of ``directory``; its URL."""
    client = s3['client']
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f'{prefix}/').get('Contents', [])
    for obj in listed:
        client.delete_object(Bucket=BUCKET, Key=obj['Key'])
    for f in sorted(directory.iterdir()):
        client.upload_file(str(f), BUCKET, f'{prefix}/{f.name}')
    return f's3://{BUCKET}/{prefix}'


def cfg(stream: dict, **knobs) -> dict:
    return {'streams': {'ds': stream}, 'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0, **knobs}


def read_epoch(config: dict) -> list[dict[str, torch.Tensor]]:
    return mix_helpers.read_epoch(config, BATCH)


def assert_same_batches(got, want) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for key in w:
            assert torch.equal(g[key], w[key]), key


def test_changed_remote_refreshes_foundrymix_cache(tmp_path, s3, small_streams, caplog):
    """Dataset A read through the cache, B uploaded over it: the next start reads B, bitwise."""
    a, b = small_streams['arxiv'], small_streams['dolly']
    url = upload(s3, a, 'changing')
    remote_cfg = cfg({'remote': url}, cache_root=str(tmp_path / 'cache'))
    assert_same_batches(read_epoch(remote_cfg), read_epoch(cfg({'local': str(a)})))
    cache = Path(StreamMixer.from_dict(remote_cfg).config.stream_dir('ds'))
    a_shards = {f for f in os.listdir(cache) if f not in METADATA}
    assert len(a_shards) >= 2  # A's shards are cached: streaming would trust them

    upload(s3, b, 'changing')  # B's shards reuse A's names (shard.00000.mds, ...), other sizes
    b_rows = StreamMixer.from_dict(cfg({'local': str(b)})).plan(BATCH).epoch_size
    with caplog.at_level(logging.WARNING, logger='foundrymix.plan.catalog'):
        plan = StreamMixer.from_dict(remote_cfg).plan(BATCH)
    assert plan.epoch_size == b_rows
    assert [r.getMessage() for r in caplog.records] == [
        f'train_loader.streams.ds: remote {url} changed since the cache {cache} was filled '
        f'(foundrymix.json and index.json differ): fetched the new metadata and removed '
        f'{len(a_shards)} stale cached shard file(s)']
    assert set(os.listdir(cache)) == METADATA
    for f in METADATA:
        assert (cache / f).read_bytes() == (b / f).read_bytes()
    assert_same_batches(read_epoch(remote_cfg), read_epoch(cfg({'local': str(b)})))

    # Endpoint gone, cache present: an error (the cache cannot be proven current), bounded.
    dead = f'http://127.0.0.1:{free_port()}'
    os.environ['S3_ENDPOINT_URL'] = dead
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger='foundrymix.s3.remote'), \
                pytest.raises(ConfigError) as err:
            StreamMixer.from_dict({**remote_cfg, 'download_timeout': 1}).validate()
    finally:
        os.environ['S3_ENDPOINT_URL'] = s3['endpoint']
    retried = [r for r in caplog.records if hasattr(r, 's3_retry')]
    assert [r.s3_retry for r in retried] == ['connect'] * len(retried)
    attempts = len(retried) + 1
    # The backoffs before a 4th attempt (0.2 + 0.4 + 0.8 s at least) pass download_timeout 1 s,
    # so no 4th attempt starts however loaded the machine (a load only leaves fewer).
    assert 1 <= attempts <= 3
    tried = f' ({attempts} attempts)' if attempts > 1 else ''
    assert str(err.value).startswith(f'train_loader.streams.ds: cannot read {url}/foundrymix.json: '
                                     f'cannot connect to {dead}{tried} (')
    assert str(err.value).endswith(f'(a copy is cached in {cache}, but without the remote nothing '
                                   f'tells whether it is current, so it is not used)')


def test_changed_remote_with_user_local_is_refused(tmp_path, s3, small_streams):
    a, b = small_streams['arxiv'], small_streams['dolly']
    url = upload(s3, a, 'user-local')
    local = tmp_path / 'mine'
    config = cfg({'remote': url, 'local': str(local)})
    StreamMixer.from_dict(config).validate()  # fills local with A's metadata
    shard = sorted(f for f in os.listdir(a) if f not in METADATA)[0]
    (local / shard).write_bytes((a / shard).read_bytes())  # and a shard, as streaming would
    before = {f: (local / f).read_bytes() for f in os.listdir(local)}

    StreamMixer.from_dict(config).validate()  # unchanged remote: fine
    upload(s3, b, 'user-local')
    with pytest.raises(ConfigError) as err:
        StreamMixer.from_dict(config).validate()
    assert str(err.value) == (
        f'train_loader.streams.ds: remote {url} changed since local {local} was filled '
        f'(foundrymix.json and index.json differ): its shard files are stale, and streaming would '
        f"read them as the new dataset's. foundrymix never deletes files in a directory you named "
        f'in local:; delete {local} (to download the new dataset there), point local: at an empty '
        f"directory, or leave local: out to use foundrymix's cache (refreshed when its remote changes)")
    assert {f: (local / f).read_bytes() for f in os.listdir(local)} == before


def fails(fn):
    """The exception ``fn`` raises."""
    with pytest.raises(Exception) as err:
        fn()
    return err.value


def test_credentials_errors_name_the_s3_code(tmp_path, s3, small_streams, monkeypatch, capsys):
    url = upload(s3, small_streams['dolly'], 'auth')
    config = cfg({'remote': url}, cache_root=str(tmp_path / 'cache'), download_timeout=5)
    manifest = f'{url}/foundrymix.json'
    with moto_auth(s3['endpoint']) as key:
        cases = [('AKIAUNKNOWN0000000000', 'whatever', 'InvalidAccessKeyId'),
                 (key['key_id'], 'wrong-secret', 'SignatureDoesNotMatch'),
                 (key['key_id'], key['secret'], 'AccessDenied')]
        for key_id, secret, code in cases:
            monkeypatch.setenv('AWS_ACCESS_KEY_ID', key_id)
            monkeypatch.setenv('AWS_SECRET_ACCESS_KEY', secret)
            with s3_requests() as requests:
                e = fails(lambda: StreamMixer.from_dict(config).validate())
            assert isinstance(e, ConfigError)
            # one request: no HEAD before the GET, and a rejection is not retried
            assert requests == [f'GET /{BUCKET}/auth/foundrymix.json'], code
            if code == 'AccessDenied':
                assert str(e).startswith(
                    f'train_loader.streams.ds: cannot read {manifest}: S3 AccessDenied: access '
                    f'denied at {s3["endpoint"]}; the credentials are valid but may not read this '
                    f'object: check the bucket policy / IAM permissions')
            else:
                assert str(e) == (
                    f'train_loader.streams.ds: cannot read {manifest}: S3 {code}: the endpoint '
                    f'{s3["endpoint"]} rejects the credentials; check AWS_ACCESS_KEY_ID / '
                    f'AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials, AWS_SESSION_TOKEN) '
                    f'are the ones for this endpoint')
        # The CLIs say the same: inspect in a subprocess, verify in-process.
        env = {k: v for k, v in os.environ.items() if not k.startswith('AWS_')}
        env.update(s3['env'], AWS_ACCESS_KEY_ID=key['key_id'], AWS_SECRET_ACCESS_KEY='wrong-secret',
                   PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'inspect', url], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2
        assert proc.stderr.startswith(f'foundrymix inspect: error: {manifest}: S3 '
                                      f'SignatureDoesNotMatch: the endpoint {s3["endpoint"]} rejects')
        monkeypatch.setenv('AWS_ACCESS_KEY_ID', 'AKIAUNKNOWN0000000000')
        capsys.readouterr()
        assert main(['verify', url, '--timeout', '5']) == 2
        assert capsys.readouterr().err.startswith(
            f'foundrymix verify: error: {manifest}: S3 InvalidAccessKeyId: the endpoint '
            f'{s3["endpoint"]} rejects the credentials')


def test_hung_endpoint_fails_within_download_timeout(tmp_path, s3, small_streams, monkeypatch):
    """An endpoint that accepts and never answers, download_timeout 2: plan (CLI) and the
    catalog fail after one attempt, whose connect and read timeouts are download_timeout
    (botocore alone: 3 x 60 s connect/read timeouts + retries)."""
    botocore = download_client(2).meta.config  # what botocore will apply to every request
    assert (botocore.connect_timeout, botocore.read_timeout) == (2, 2)
    assert botocore.retries['total_max_attempts'] == 1
    url = upload(s3, small_streams['dolly'], 'hung')
    accepted: list = []
    with silent_server(accepted) as hung:
        monkeypatch.setenv('S3_ENDPOINT_URL', hung)
        config = cfg({'remote': url}, cache_root=str(tmp_path / 'cache'), download_timeout=2)
        e = fails(lambda: StreamMixer.from_dict(config).validate())
        assert len(accepted) == 1  # one attempt: its timeout took the whole download_timeout
        assert str(e) == (
            f'train_loader.streams.ds: cannot read {url}/foundrymix.json: no answer from {hung} within '
            f'2 s (download_timeout); check S3_ENDPOINT_URL, the network and any proxy, or raise '
            f'download_timeout for a slow store')
        run = tiny_run_config(config, global_train_batch_size=BATCH, max_duration='1ep')
        (tmp_path / 'run.yaml').write_text(yaml.safe_dump(run))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'plan', str(tmp_path / 'run.yaml')],
                              env=env, capture_output=True, text=True, timeout=300)
        assert len(accepted) == 2  # the CLI's one attempt
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f'foundrymix plan: error: train_loader.streams.ds: cannot read '
                                  f'{url}/foundrymix.json: no answer from {hung} within 2 s')


def test_plan_and_inspect_fetch_only_metadata(tmp_path, s3, small_streams):
    url = upload(s3, small_streams['arxiv'], 'meta-only')
    cache = tmp_path / 'cache'
    config = cfg({'remote': url}, cache_root=str(cache))
    with s3_requests() as requests:
        StreamMixer.from_dict(config).plan(BATCH, '10ba')
    assert sorted(requests) == [f'GET /{BUCKET}/meta-only/foundrymix.json',
                                f'GET /{BUCKET}/meta-only/index.json']
    stream_dir = Path(StreamMixer.from_dict(config).config.stream_dir('ds'))
    assert {str(p.relative_to(cache)) for p in cache.rglob('*') if p.is_file()} == {
        str((stream_dir / f).relative_to(cache)) for f in METADATA}

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with s3_requests() as requests:
        proc = subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'inspect', url, '--json'],
                              env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads((small_streams['arxiv'] / 'foundrymix.json').read_text())
    assert requests == [f'GET /{BUCKET}/meta-only/foundrymix.json']


def test_hung_endpoint_during_training_names_the_shard(tmp_path, s3, small_streams, monkeypatch):
    """Metadata fetched, then the endpoint hangs: reading a batch fails naming the shard,
    each shard tried at most download_retry times (by the read, or once by the prefetch
    whose failure the read then raises), each attempt bounded by download_timeout."""
    url = upload(s3, small_streams['dolly'], 'hung-shards')
    mixer = StreamMixer.from_dict(cfg({'remote': url}, cache_root=str(tmp_path / 'cache'),
                                      download_timeout=2, download_retry=1))
    mixer.validate()
    accepted: list = []
    with silent_server(accepted) as hung:
        monkeypatch.setenv('S3_ENDPOINT_URL', hung)
        loader = mixer.build_dataloader(batch_size=BATCH)
        e = fails(lambda: next(iter(loader)))
        shards = len(json.loads(Path(small_streams['dolly'], 'index.json').read_text())['shards'])
        assert 1 <= len(accepted) <= shards  # one connection per shard attempted, no more
    cache = mixer.config.stream_dir('ds')
    assert type(e).__name__ == 'ShardPrepareError'
    assert str(e).startswith(
        f"stream 'ds' ({cache}), shard shard.0000")
    assert (f'could not fetch the shard: RemoteError: {url}/shard.0000' in str(e)
            and f': no answer from {hung} within 2 s (download_timeout)' in str(e))
    del loader
    gc.collect()


def test_inspect_decode_remote_fetches_only_the_shards_it_shows(s3, small_streams, capsys):
    local = small_streams['dolly']
    url = upload(s3, local, 'decode')
    assert main(['inspect', str(local), '--decode', '2']) == 0
    want = capsys.readouterr().out.split('no loss on text in')[1]
    with s3_requests() as requests:
        assert main(['inspect', url, '--decode', '2']) == 0
    out = capsys.readouterr().out
    assert out.split('no loss on text in')[1] == want and url in out
    index = json.loads((local / 'index.json').read_text())
    assert int(index['shards'][0]['samples']) >= 2  # so the first shard alone holds the 2 rows
    assert requests == [f'GET /{BUCKET}/decode/{f}' for f in
                        ('foundrymix.json', 'index.json', index['shards'][0]['raw_data']['basename'])]
