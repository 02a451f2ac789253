"""Remote streams over a real HTTP S3 endpoint (moto's server on 127.0.0.1).

Real shards converted from the bundled samples are uploaded with boto3; the mixer and
streaming then talk to the endpoint through ``S3_ENDPOINT_URL``, exactly as against AWS
or any S3-compatible store. Checked: planning downloads only ``foundrymix.json`` and
``index.json`` and gives the same numbers as the local copy; an epoch read from S3 is
the local epoch (same order, bitwise-equal tensors); missing remotes fail up front
naming the stream and remote path; ``train.py`` trains on ``s3://`` streams.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer

ROOT = Path(__file__).resolve().parents[2]
BUCKET = 'fmx-test'
from helpers import free_port, moto_s3, tiny_run_config
BATCH = 6
METADATA = {'foundrymix.json', 'index.json'}




@pytest.fixture(scope='module')
def s3():
    """A moto S3 server on 127.0.0.1, with the env streaming/boto3 read pointed at it."""
    with moto_s3(BUCKET) as server:
        yield server


@pytest.fixture(scope='module')
def data(small_streams) -> dict[str, Path]:
    """Part of one arXiv paper (pretrain) and 150 Dolly examples (finetune), several shards each."""
    return small_streams


def shard_files(stream_dir: Path) -> set[str]:
    index = json.loads((stream_dir / 'index.json').read_text())
    return {shard['raw_data']['basename'] for shard in index['shards']}


@pytest.fixture(scope='module')
def bucket(s3, data) -> dict[str, str]:
    """Both stream directories uploaded whole to s3://fmx-test/<name>/."""
    remotes = {}
    for name, d in data.items():
        for f in sorted(d.iterdir()):
            s3['client'].upload_file(str(f), BUCKET, f'{name}/{f.name}')
        remotes[name] = f's3://{BUCKET}/{name}'
    return remotes


def loader_cfg(paths: dict[str, str], kind: str, cache_root: Path | None = None) -> dict:
    """The same mixture over local dirs (``kind='local'``) or remote-only streams."""
    weights = {'arxiv': {'repeat': 1.5}, 'dolly': {}}
    cfg: dict = {'streams': {name: {kind: str(paths[name]), **weights[name]} for name in weights},
                 'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0}
    if cache_root is not None:
        cfg['cache_root'] = str(cache_root)
    return cfg


def files_under(root: Path) -> dict[str, set[str]]:
    """{directory relative to root: file names} for every file under root."""
    out: dict[str, set[str]] = {}
    for dirpath, _, names in os.walk(root):
        if names:
            out[os.path.relpath(dirpath, root)] = set(names)
    return out


def read_epoch(mixer: StreamMixer) -> list[dict[str, torch.Tensor]]:
    loader = mixer.build_dataloader(batch_size=BATCH)
    batches = [{k: v.clone() for k, v in b.items()} for b in loader]
    loader.release()
    return batches


@pytest.fixture(scope='module')
def local_epoch(data) -> list[dict[str, torch.Tensor]]:
    return read_epoch(StreamMixer.from_dict(loader_cfg(data, 'local')))


def test_bucket_holds_several_shards_per_stream(s3, bucket, data):
    """Precondition of the download checks below: shards are separate objects in the bucket."""
    for name, d in data.items():
        listed = s3['client'].list_objects_v2(Bucket=BUCKET, Prefix=f'{name}/')
        keys = {o['Key'].split('/', 1)[1] for o in listed['Contents']}
        assert keys == METADATA | shard_files(d)
        assert len(shard_files(d)) >= 2


def test_plan_downloads_only_manifest_and_index(tmp_path, bucket, data):
    cache = tmp_path / 'cache'
    mixer = StreamMixer.from_dict(loader_cfg(bucket, 'remote', cache))
    mixer.validate()
    plan = mixer.plan(BATCH, '30ba')
    expected = {os.path.relpath(mixer.config.stream_dir(n), cache): METADATA for n in ('arxiv', 'dolly')}
    assert files_under(cache) == expected  # no shard was fetched
    for name in ('arxiv', 'dolly'):
        cached = Path(mixer.config.stream_dir(name))
        for f in METADATA:
            assert (cached / f).read_bytes() == (data[name] / f).read_bytes()

    local = StreamMixer.from_dict(loader_cfg(data, 'local')).plan(BATCH, '30ba')
    assert plan.to_dict() == local.to_dict()
    rows = {n: json.loads((data[n] / 'foundrymix.json').read_text())['counts']['rows'] for n in data}
    nominal = int(1.5 * rows['arxiv']) + rows['dolly']  # the numbers compared are real
    assert sum(plan.nominal_rows_per_epoch.values()) == nominal
    assert plan.epoch_size == nominal - nominal % plan.global_batch_size  # exact: whole batches
    assert plan.batches_per_epoch == plan.epoch_size // BATCH


def test_epoch_from_s3_is_the_local_epoch_bitwise(tmp_path, bucket, data, local_epoch):
    cache = tmp_path / 'cache'
    mixer = StreamMixer.from_dict(loader_cfg(bucket, 'remote', cache))
    remote_epoch = read_epoch(mixer)
    n_batches = StreamMixer.from_dict(loader_cfg(data, 'local')).plan(BATCH).batches_per_epoch
    assert len(remote_epoch) == len(local_epoch) == n_batches > 5
    for got, want in zip(remote_epoch, local_epoch):
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    ids = [i for b in local_epoch for i in b['sample_id'].tolist()]
    assert len(ids) == n_batches * BATCH and len(set(ids)) < len(ids)  # arxiv repeat 1.5: some rows twice
    # Every shard really came over HTTP into the cache (the config names no local dir).
    for name in ('arxiv', 'dolly'):
        cached = files_under(Path(mixer.config.stream_dir(name)))['.']
        assert cached == METADATA | shard_files(data[name])


@pytest.mark.parametrize('remote, message', [
    (f's3://{BUCKET}/nothere',
     "train_loader.streams.dolly: no foundrymix manifest at s3://fmx-test/nothere/foundrymix.json "
     "(NoSuchKey: no such object). Check that remote 's3://fmx-test/nothere' (bucket and path)"),
    ('s3://fmx-no-such-bucket/dolly',
     "train_loader.streams.dolly: cannot read s3://fmx-no-such-bucket/dolly/foundrymix.json: S3 "
     "NoSuchBucket: no bucket 'fmx-no-such-bucket' at http://127.0.0.1:"),
    (f's3://{BUCKET}/partial',
     "train_loader.streams.dolly: no index.json at s3://fmx-test/partial/index.json (NoSuchKey: no "
     "such object), though foundrymix.json is there: an incomplete conversion or upload? Re-run "
     "`foundrymix convert` into 's3://fmx-test/partial' (it uploads index.json last)"),
])
def test_missing_remote_names_stream_and_path(tmp_path, s3, bucket, data, remote, message):
    if remote.endswith('/partial'):  # a manifest uploaded without its index
        s3['client'].upload_file(str(data['dolly'] / 'foundrymix.json'), BUCKET, 'partial/foundrymix.json')
    cache = tmp_path / 'cache'
    paths = dict(bucket, dolly=remote)
    mixer = StreamMixer.from_dict(loader_cfg(paths, 'remote', cache))
    with pytest.raises(ConfigError) as err:
        mixer.validate()
    assert str(err.value).startswith(message)
    # Nothing half-downloaded is left where the next run would take it for a cached file
    # (the manifest is installed only with its index).
    dolly_dir = Path(mixer.config.stream_dir('dolly'))
    assert files_under(dolly_dir).get('.', set()) == set()


def test_unreachable_endpoint_names_stream_and_path(tmp_path, bucket, monkeypatch):
    dead = f'http://127.0.0.1:{free_port()}'
    monkeypatch.setenv('S3_ENDPOINT_URL', dead)
    mixer = StreamMixer.from_dict(loader_cfg(bucket, 'remote', tmp_path / 'cache'))
    with pytest.raises(ConfigError) as err:
        mixer.validate()
    assert str(err.value).startswith(
        f'train_loader.streams.arxiv: cannot read s3://fmx-test/arxiv/foundrymix.json: cannot '
        f'connect to {dead} (5 attempts) (Could not connect to the endpoint URL: "{dead}/')


@pytest.mark.slow
def test_train_py_on_s3_streams(tmp_path, s3, bucket, data, local_epoch):
    """A real ``python train.py`` run on remote-only streams, endpoint passed through the env."""
    cache = tmp_path / 'cache'
    cfg = tiny_run_config(
        loader_cfg(bucket, 'remote', cache), run_name='s3-test', global_train_batch_size=BATCH,
        max_duration='5ba', save_folder=str(tmp_path / 'ckpt'), save_interval='5ba',
        callbacks={'sample_log': {'path': str(tmp_path / 'samples.jsonl')},
                   'stream_accounting': {'out_dir': str(tmp_path / 'report')}})
    (tmp_path / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    env = {k: v for k, v in os.environ.items() if not k.startswith('AWS_') and k != 'S3_ENDPOINT_URL'}
    env.update(s3['env'])
    proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), 'c.yaml'], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    log = [json.loads(line) for line in (tmp_path / 'samples.jsonl').read_text().splitlines()]
    assert [b['batch'] for b in log] == list(range(5))
    assert [b['sample_ids'] for b in log] == [b['sample_id'].tolist() for b in local_epoch[:5]]
    assert [b['stream_ids'] for b in log] == [b['stream_id'].tolist() for b in local_epoch[:5]]
    assert (tmp_path / 'ckpt' / 'ep0-ba5-rank0.pt').is_file()
    report = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    assert report['total']['samples'] == 5 * BATCH
    mixer = StreamMixer.from_dict(cfg['train_loader'])
    for name in ('arxiv', 'dolly'):  # the trainer read the shards it needed from the bucket
        cached = files_under(Path(mixer.config.stream_dir(name)))['.']
        assert METADATA < cached <= METADATA | shard_files(data[name])
