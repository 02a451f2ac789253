"""``foundrymix convert ... --out s3://bucket/prefix`` against a real S3 endpoint (moto's server
on 127.0.0.1), through the fault proxy where the wire matters.

Checked: the uploaded objects are byte for byte a local conversion of the same input; shards
go up while the conversion runs (the staging directory never holds more than the upload
window) and ``foundrymix.json``/``index.json`` last; ``verify`` and the loader read the
result; an existing dataset is refused and ``--overwrite`` deletes the old index first and
only objects foundrymix wrote; 503s, resets and delays change nothing but the retry count,
which the summary reports exactly; a permanent error or SIGKILL mid-upload leaves no index;
a bad bucket or endpoint fails before the tokenizer is even loaded.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fault_proxy import FaultProxy
from foundrymix.cli import main
from foundrymix.convert import upload
from foundrymix.convert.paths import UnsafePathsError
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.convert.upload import RemoteOutputError
from helpers import ROOT, SAMPLES, SMALL_SEQ, free_port, moto_s3

BUCKET = 'fmx-convert'


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


@pytest.fixture(autouse=True)
def _env(s3, monkeypatch, tmp_path):
    """Every test talks to the module's moto server (a test may point S3_ENDPOINT_URL at a
    proxy) and stages uploads in a temp dir of its own, which it can inspect."""
    for key, value in s3['env'].items():
        monkeypatch.setenv(key, value)
    staging = tmp_path / 'tmp'
    staging.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(staging))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory) -> Path:
    """One arXiv paper: 161 rows of 128 tokens, 13 shards of 4 kB."""
    root = tmp_path_factory.mktemp('corpus')
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        (root / 'paper.jsonl').write_text(f.readline(), encoding='utf-8')
    return root / 'paper.jsonl'


def options(**kw) -> PretrainOptions:
    return PretrainOptions(**{'max_seq_len': SMALL_SEQ, 'workers': 1, 'size_limit': '4kb', **kw})


@pytest.fixture(scope='module')
def reference(corpus, tmp_path_factory) -> dict[str, bytes]:
    """The local conversion every upload must equal, file by file."""
    out = tmp_path_factory.mktemp('ref') / 'ref'
    convert_pretrain([str(corpus)], str(out), options())
    return files(out)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def objects(s3, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix/`` (read directly from moto, not through a proxy)."""
    client = s3['client']
    keys = [o['Key'] for page in client.get_paginator('list_objects_v2').paginate(Bucket=BUCKET, Prefix=f'{prefix}/')
            for o in page.get('Contents', [])]
    return {k[len(prefix) + 1:]: client.get_object(Bucket=BUCKET, Key=k)['Body'].read() for k in keys}


def shard_names(index_bytes: bytes) -> set[str]:
    return {s['raw_data']['basename'] for s in json.loads(index_bytes)['shards']}


def requests(proxy: FaultProxy, method: str) -> list[str]:
    """Object names (relative to the bucket) of the ``method`` requests the proxy forwarded."""
    return [path.split('?')[0].split(f'/{BUCKET}/', 1)[-1] for m, path, what in proxy.log
            if m == method and what in ('forward', 'delay') and f'/{BUCKET}/' in path]


def test_upload_is_the_local_conversion_while_it_runs_and_reads_back(s3, corpus, reference, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(upload, 'MAX_PENDING', 2)
    staged: list[int] = []  # shard files in the staging dir at each request

    def watch(method: str, path: str) -> bool:
        staged.append(len(list(Path(tempfile.tempdir).glob('.foundrymix-upload-*/shard.*'))))
        return False

    with FaultProxy(s3['endpoint'], should_fault=watch) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        convert_pretrain([str(corpus)], f's3://{BUCKET}/run1', options())
    assert objects(s3, 'run1') == reference  # bitwise, same names, nothing else
    n_shards = len(shard_names(reference['index.json']))
    assert n_shards == 13
    puts = requests(proxy, 'PUT')
    assert puts[-2:] == ['run1/foundrymix.json', 'run1/index.json'] and len(puts) == n_shards + 2
    # shards were uploaded while later ones were still being written: the staging dir never
    # held more than the upload window (2) plus the one shard waiting for it
    assert max(staged) <= 3 < n_shards
    # (foundrymix-claims: the machine-wide claims directory, lock files only -- not staging)
    assert [n for n in os.listdir(tempfile.tempdir) if n != 'foundrymix-claims'] == []  # staging directory removed

    monkeypatch.setenv('S3_ENDPOINT_URL', s3['endpoint'])
    assert main(['verify', f's3://{BUCKET}/run1']) == 0
    from foundrymix.loader.mixer import StreamMixer

    def epoch(stream: dict) -> list[list[int]]:
        mixer = StreamMixer.from_dict({'streams': {'paper': stream}, 'shuffle': False, 'num_workers': 0,
                                       'cache_root': str(tmp_path / 'cache')})
        return [b['input_ids'].tolist() for b in mixer.build_dataloader(batch_size=5)]

    local = tmp_path / 'local'
    local.mkdir()
    for name, blob in reference.items():
        (local / name).write_bytes(blob)
    remote_rows = epoch({'remote': f's3://{BUCKET}/run1'})
    assert len(remote_rows) == 161 // 5  # whole batches
    assert remote_rows == epoch({'local': str(local)})


def test_keep_local_copy_follows_the_local_rules(s3, corpus, reference, tmp_path, capsys):
    out = tmp_path / 'copy'
    args = ['convert', 'pretrain', str(corpus), '--out', f's3://{BUCKET}/kept', '--keep-local', str(out),
            '--max-seq-len', str(SMALL_SEQ), '--workers', '1', '--size-limit', '4kb']
    assert main(args) == 0
    assert files(out) == reference == objects(s3, 'kept')
    assert f'Uploaded 15 objects' in capsys.readouterr().err
    # the local copy still may not be (in) an input directory, and nothing was uploaded
    assert main(['convert', 'pretrain', str(corpus.parent), '--out', f's3://{BUCKET}/kept2',
                 '--keep-local', str(corpus.parent / 'x'), *args[7:]]) == 2
    assert 'is inside the input directory' in capsys.readouterr().err
    assert objects(s3, 'kept2') == {}
    assert main(['convert', 'pretrain', str(corpus), '--out', str(tmp_path / 'y'), '--keep-local',
                 str(out)]) == 2
    assert 'only with --out s3://' in capsys.readouterr().err
    assert objects(s3, 'kept') == reference


def test_existing_dataset_is_refused_and_overwrite_deletes_only_what_foundrymix_wrote(
        s3, corpus, reference, monkeypatch):
    url = f's3://{BUCKET}/run2'
    convert_pretrain([str(corpus)], url, options(size_limit='2kb'))  # more shards than the new one
    s3['client'].put_object(Bucket=BUCKET, Key='run2/notes.txt', Body=b'mine')
    before = objects(s3, 'run2')
    old_shards = shard_names(before['index.json'])
    with pytest.raises(RemoteOutputError, match=rf'--out {url}: the prefix holds a dataset .*--overwrite'):
        convert_pretrain([str(corpus)], url, options())
    assert objects(s3, 'run2') == before

    with FaultProxy(s3['endpoint']) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        convert_pretrain([str(corpus)], url, options(overwrite=True))
    monkeypatch.setenv('S3_ENDPOINT_URL', s3['endpoint'])
    assert objects(s3, 'run2') == {**reference, 'notes.txt': b'mine'}
    # old index and manifest went before the first new shard, old shards after the new index
    events = [(m, p) for m, p, what in proxy.log if m in ('PUT', 'DELETE')]
    names = [(m, p.split('?')[0].rsplit('/', 1)[-1]) for m, p in events]
    # (the old shard list is saved first, for a next --overwrite should this one fail)
    assert names[:3] == [('PUT', '.foundrymix-replacing.json'), ('DELETE', 'index.json'),
                         ('DELETE', 'foundrymix.json')]
    last_put = max(i for i, (m, _) in enumerate(names) if m == 'PUT')
    assert names[last_put] == ('PUT', 'index.json')
    deleted = [n for m, n in names[last_put:] if m == 'DELETE']
    assert deleted[-1] == '.foundrymix-replacing.json'
    assert set(deleted[:-1]) == old_shards - shard_names(reference['index.json']) and len(deleted) > 5

    # a shard-named object foundrymix did not write is never replaced, even with --overwrite
    s3['client'].put_object(Bucket=BUCKET, Key='run2/shard.09999.mds', Body=b'not ours')
    with pytest.raises(RemoteOutputError, match=r'run2/shard.09999.mds is named like a shard'):
        convert_pretrain([str(corpus)], url, options(overwrite=True))
    # any other object makes the prefix "not empty"
    s3['client'].put_object(Bucket=BUCKET, Key='run3/notes.txt', Body=b'mine')
    with pytest.raises(RemoteOutputError, match=r'the prefix is not empty .*--overwrite'):
        convert_pretrain([str(corpus)], f's3://{BUCKET}/run3', options())


def test_upload_under_faults_is_bitwise_the_same_and_counts_the_retries(s3, corpus, reference, monkeypatch,
                                                                         caplog):
    caplog.set_level(logging.INFO, logger='foundrymix.convert.upload')
    with FaultProxy(s3['endpoint'], error_rate=0.2, reset_rate=0.2, delay_rate=0.1, delay_s=0.05,
                    seed=1) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        convert_pretrain([str(corpus)], f's3://{BUCKET}/faulty', options())
    assert objects(s3, 'faulty') == reference
    faults = proxy.counts['503'] + proxy.counts['reset']
    assert proxy.counts['503'] >= 2 and proxy.counts['reset'] >= 1 and proxy.counts['delay'] >= 1
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith('uploaded')]
    assert len(summary) == 1
    assert f': {faults} retries (' in summary[0] and f"SlowDown {proxy.counts['503']}" in summary[0]


@pytest.mark.parametrize('fail_at', ['shard.00003.mds', 'index.json'])
def test_permanent_error_leaves_no_index_and_overwrite_recovers(s3, corpus, reference, monkeypatch,
                                                                tmp_path, fail_at):
    """503s on every attempt of one PUT while replacing a dataset uploaded by other means
    (``aws s3 sync``: no foundrymix tag): the conversion fails naming the object and the code,
    removes what it uploaded and leaves no index; a local copy is published only if complete;
    the next ``--overwrite`` still knows the old shards and finishes the job."""
    old = {f'{name}' + ('' if name.endswith('.json') else '.old'): blob for name, blob in reference.items()}
    old['index.json'] = reference['index.json'].replace(b'.mds"', b'.mds.old"')
    for name, blob in old.items():
        s3['client'].put_object(Bucket=BUCKET, Key=f'broken/{name}', Body=blob)
    monkeypatch.setenv('AWS_MAX_ATTEMPTS', '2')
    copy = tmp_path / 'copy'
    with FaultProxy(s3['endpoint'], error_rate=1.0, max_faults_per_request=10 ** 6,
                    should_fault=lambda m, p: m == 'PUT' and p.split('?')[0].endswith(fail_at)) as proxy:
        monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        with pytest.raises(RemoteOutputError, match=rf's3://{BUCKET}/broken/{fail_at}: uploading .*SlowDown'):
            convert_pretrain([str(corpus)], (str(copy), f's3://{BUCKET}/broken'), options(overwrite=True))
    assert proxy.counts['503'] == 2  # AWS_MAX_ATTEMPTS
    monkeypatch.setenv('S3_ENDPOINT_URL', s3['endpoint'])
    left = objects(s3, 'broken')
    assert set(left) == {n for n in old if n.endswith('.old')} | {'.foundrymix-replacing.json'}
    # (foundrymix-claims: the machine-wide claims directory, lock files only -- not staging)
    assert [n for n in os.listdir(tempfile.tempdir) if n != 'foundrymix-claims'] == []
    if fail_at == 'index.json':  # converted completely: the local copy is kept
        assert files(copy) == reference
    else:
        assert not copy.exists() and os.listdir(tmp_path) == ['tmp']
    convert_pretrain([str(corpus)], f's3://{BUCKET}/broken', options(overwrite=True))
    assert objects(s3, 'broken') == reference  # old shards and the marker removed


def test_sigkill_mid_upload_leaves_no_index_and_overwrite_recovers(s3, corpus, reference, monkeypatch,
                                                                   tmp_path):
    with FaultProxy(s3['endpoint'], delay_rate=1.0, delay_s=0.3,
                    should_fault=lambda m, p: m == 'PUT') as proxy:
        env = {**os.environ, **s3['env'], 'S3_ENDPOINT_URL': proxy.endpoint, 'TMPDIR': tempfile.tempdir,
               'PYTHONPATH': str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(corpus), '--out',
             f's3://{BUCKET}/killed', '--max-seq-len', str(SMALL_SEQ), '--workers', '1',
             '--size-limit', '2kb', '--no-progress'], env=env, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300  # a hang guard (start-up and imports, loaded machine)
        while len(objects(s3, 'killed')) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = objects(s3, 'killed')
    assert len(left) >= 3 and 'index.json' not in left and 'foundrymix.json' not in left
    staging = lambda: [n for n in os.listdir(tempfile.tempdir) if n.startswith('.foundrymix-upload-')]
    assert len(staging()) == 1  # the killed run's staging directory
    with pytest.raises(RemoteOutputError, match='leftovers of an interrupted conversion'):
        convert_pretrain([str(corpus)], f's3://{BUCKET}/killed', options())
    convert_pretrain([str(corpus)], f's3://{BUCKET}/killed', options(overwrite=True))
    assert objects(s3, 'killed') == reference  # leftovers replaced or removed (they carry our tag)
    assert staging() == []  # stale staging directory of the dead pid removed


@pytest.mark.slow  # a local Ray starts (12-30 s)
def test_ray_engine_uploads_the_same_objects(s3, corpus, tmp_path):
    """``--engine ray`` to s3:// publishes what it writes locally (per-task shards under
    ``task-NNNNN/``), object for object."""
    ray = pytest.importorskip('ray')
    papers = tmp_path / 'papers.jsonl'  # three papers: two tasks
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        papers.write_text(''.join(next(f) for _ in range(3)), encoding='utf-8')
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray_options = options(engine='ray', chunk_bytes=16 << 10, ray_task_bytes=32 << 10)
        convert_pretrain([str(papers)], str(tmp_path / 'ray'), ray_options)
        convert_pretrain([str(papers)], f's3://{BUCKET}/ray', ray_options)
    finally:
        ray.shutdown()
    local = {str(p.relative_to(tmp_path / 'ray')): p.read_bytes()
             for p in sorted((tmp_path / 'ray').rglob('*')) if p.is_file()}
    assert objects(s3, 'ray') == local
    assert {name.split('/')[0] for name in local if '/' in name} == {'task-00000', 'task-00001'}
    assert [n for n in os.listdir(tempfile.tempdir) if n.startswith('.foundrymix-upload-')] == []


@pytest.mark.parametrize('out, endpoint, engine, message', [
    (f's3://no-such-bucket/x', None, 'ray', r's3://no-such-bucket/x: listing the prefix .*NoSuchBucket.*check the bucket name'),
    (f's3://{BUCKET}/x', 'dead', 'local', rf's3://{BUCKET}/x: .*EndpointConnectionError.*endpoint is up'),
    ('gs://bucket/x', None, 'local', r'only s3://bucket/prefix is supported'),
])
def test_bad_remote_fails_before_any_work(corpus, monkeypatch, caplog, out, endpoint, engine, message):
    """The tokenizer named does not exist: the S3 error coming first shows that the prefix
    is checked before anything is loaded or tokenized (nor Ray started); a dead endpoint is
    given the up-front check's 3 attempts, not the upload client's."""
    if endpoint == 'dead':
        monkeypatch.setenv('S3_ENDPOINT_URL', f'http://127.0.0.1:{free_port()}')
    with caplog.at_level(logging.DEBUG, logger='botocore.endpoint'), \
            pytest.raises((RemoteOutputError, UnsafePathsError), match=message):
        convert_pretrain([str(corpus)], out, options(tokenizer='no-such-tokenizer', engine=engine))
    sent = [r for r in caplog.records if r.name == 'botocore.endpoint'
            and str(r.msg).startswith('Sending http request')]
    assert len(sent) == {'dead': 3, None: 1 if out.startswith('s3://') else 0}[endpoint]
    assert 'ray' not in sys.modules or not sys.modules['ray'].is_initialized()


@pytest.mark.parametrize('flag, wording', [
    ('--out', 'supported as a remote output (for another store, convert to a local directory and copy it)'),
    ('adopt', 'supported as a remote source (for another store, copy it to a local directory first)'),
])
def test_a_non_s3_url_is_refused_as_what_it_is(flag, wording):
    """An output is converted elsewhere and copied; a source is copied first: each is told its own fix."""
    from foundrymix.convert.upload import parse_s3_url
    with pytest.raises(RemoteOutputError) as e:
        parse_s3_url('gs://bucket/x', flag)
    assert str(e.value) == f'{flag} gs://bucket/x: only s3://bucket/prefix is {wording}'
