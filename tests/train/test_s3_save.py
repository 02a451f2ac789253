"""Checkpoints saved to ``s3://`` (moto's server on 127.0.0.1) through a flaky or dead store.

Checked: behind a proxy answering 503 SlowDown or resetting the connection (up to 4 times in a
row for each request: more than the 3 attempts Composer's uploader makes), a run saving and
listing there ends with every checkpoint bitwise the straight run's and the same sample log; a
store refusing one checkpoint's upload for good stops the run with one line naming it and its
local copy (bitwise the straight run's checkpoint), exit 2, no traceback, and nothing after it
(pointer included) in the bucket; a store that accepts and never answers is named after one
attempt of download_timeout at start (listing, multipart clean-up); the unfinished multipart
uploads of our checkpoint names are aborted at start, others kept.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fault_proxy import FaultProxy
from helpers import ROOT, free_port, moto_s3, silent_server, tiny_run_config

BUCKET = 'fmx-save'
BATCH = 6
N_BATCHES = 12


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


def run_cfg(tmp: Path, streams: dict, **top) -> dict:
    data = {'streams': {'arxiv': {'local': str(streams['arxiv']), 'repeat': 1.5},
                        'dolly': {'local': str(streams['dolly'])}},
            'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0}
    return tiny_run_config(data, global_train_batch_size=BATCH, max_duration=f'{N_BATCHES}ba',
                           save_interval='4ba', log_interval='4ba',
                           scheduler={'name': 'cosine_with_warmup', 't_warmup': '2ba', 'alpha_f': 0.1},
                           callbacks={'sample_log': {'path': str(tmp / 'samples.jsonl')}}, **top)


def train(cwd: Path, cfg: dict, env: dict) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    run_env = {k: v for k, v in os.environ.items() if not k.startswith('AWS_') and k != 'S3_ENDPOINT_URL'}
    run_env.update(env)
    return subprocess.run([sys.executable, str(ROOT / 'train.py'), 'c.yaml'], cwd=cwd, env=run_env,
                          capture_output=True, text=True, timeout=600)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    return proc


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location='cpu', weights_only=False)['state']['model']


def same_weights(got: Path, want: Path) -> bool:
    a, b = weights(got), weights(want)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def keys(s3, prefix: str) -> set[str]:
    listed = s3['client'].list_objects_v2(Bucket=BUCKET, Prefix=prefix).get('Contents', [])
    return {o['Key'][len(prefix):] for o in listed}


def unfinished(s3, prefix: str) -> list[str]:
    return [u['Key'] for u in s3['client'].list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get('Uploads', [])]


@pytest.fixture(scope='module')
def straight(tmp_path_factory, small_streams, s3) -> Path:
    """The uninterrupted run, checkpoints in a local folder."""
    d = tmp_path_factory.mktemp('straight')
    ok(train(d, run_cfg(d, small_streams, run_name='straight', save_folder=str(d / 'ckpt')), s3['env']))
    return d


@pytest.mark.slow  # two whole train.py runs
@pytest.mark.timeout(1800)
def test_checkpoints_through_503s_and_resets_are_the_straight_runs(tmp_path, s3, small_streams, straight):
    prefix = 'runs/flaky/ckpts/'
    cfg = run_cfg(tmp_path, small_streams, run_name='flaky', save_folder=f's3://{BUCKET}/{prefix}',
                  autoresume=True)  # the listing at start goes through the proxy too
    with FaultProxy(s3['endpoint'], error_rate=0.3, reset_rate=0.2, max_faults_per_request=4, seed=7) as proxy:
        out = ok(train(tmp_path, cfg, {**s3['env'], 'S3_ENDPOINT_URL': proxy.endpoint}))
    assert proxy.counts['503'] > 0 and proxy.counts['reset'] > 0, proxy.counts
    assert any(m == 'GET' and w != 'forward' for m, _, w in proxy.log)  # the listing retried
    assert any(m == 'PUT' and w != 'forward' for m, _, w in proxy.log)  # an upload retried
    assert 'Traceback' not in out.stderr
    names = [f'ep0-ba{b}-rank0.pt' for b in (4, 8, 12)]
    assert keys(s3, prefix) == {*names, 'latest-rank0.pt.symlink'}
    link = s3['client'].get_object(Bucket=BUCKET, Key=prefix + 'latest-rank0.pt.symlink')['Body'].read()
    assert link.decode() == prefix + names[-1]
    for name in names:
        s3['client'].download_file(BUCKET, prefix + name, str(tmp_path / name))
        assert same_weights(tmp_path / name, straight / 'ckpt' / name), name
    assert (tmp_path / 'samples.jsonl').read_text() == (straight / 'samples.jsonl').read_text()
    assert unfinished(s3, prefix) == []


@pytest.mark.slow  # two train.py ranks on gloo
@pytest.mark.timeout(1800)
def test_an_upload_that_fails_on_rank_0_stops_both_ranks_each_in_one_line(tmp_path, s3, small_streams):
    """Rank 0 alone uploads; when its upload fails for good, every rank stops at one batch (the
    loader's agreement), rank 0 naming the checkpoint and rank 1 naming rank 0 -- neither waits in
    the next gradient all-reduce. Started as ``composer -n 2`` starts ranks, without its launcher
    (which would kill the other rank as soon as one exits)."""
    prefix = 'runs/dead2/ckpts/'
    cfg = {**run_cfg(tmp_path, small_streams, run_name='dead2', save_folder=f's3://{BUCKET}/{prefix}'),
           'max_duration': '60ba'}  # far past the batch the failure is seen at
    (tmp_path / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    port = str(free_port())
    with FaultProxy(s3['endpoint'], error_rate=1.0, max_faults_per_request=10 ** 6,
                    should_fault=lambda method, path: method == 'PUT' and 'ep0-ba4-rank0.pt' in path) as proxy:
        base = {k: v for k, v in os.environ.items() if not k.startswith('AWS_') and k != 'S3_ENDPOINT_URL'}
        procs = [subprocess.Popen(
            [sys.executable, str(ROOT / 'train.py'), 'c.yaml'], cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**base, **s3['env'], 'S3_ENDPOINT_URL': proxy.endpoint, 'AWS_MAX_ATTEMPTS': '2',
                 'RANK': str(rank), 'LOCAL_RANK': str(rank), 'NODE_RANK': '0', 'WORLD_SIZE': '2',
                 'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': port})
            for rank in range(2)]
        try:
            ends = [p.communicate(timeout=900) for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert [p.returncode for p in procs] == [2, 2], [err[-3000:] for _, err in ends]
    lines = [[line for line in err.splitlines() if line.startswith('foundrymix train: error:')] for _, err in ends]
    assert all('Traceback' not in err for _, err in ends), [err[-3000:] for _, err in ends]
    assert len(lines[0]) == 1 and lines[0][0].startswith(
        f'foundrymix train: error: checkpoint upload failed, the run stopped: s3://{BUCKET}/{prefix}ep0-ba4-rank0.pt: '
        f'SlowDown'), lines[0]
    said = lines[0][0].removeprefix('foundrymix train: error: ')
    assert lines[1] == [f'foundrymix train: error: rank 0 stopped, so every rank stops here: FoundrymixError: {said}']


@pytest.mark.slow  # a whole train.py run
@pytest.mark.timeout(1800)
def test_an_upload_that_fails_for_good_stops_the_run_in_one_line(tmp_path, s3, small_streams, straight):
    prefix = 'runs/dead/ckpts/'
    refused = 'ep0-ba8-rank0.pt'
    cfg = run_cfg(tmp_path, small_streams, run_name='dead', save_folder=f's3://{BUCKET}/{prefix}')
    with FaultProxy(s3['endpoint'], error_rate=1.0, max_faults_per_request=10 ** 6,
                    should_fault=lambda method, path: method == 'PUT' and refused in path) as proxy:
        # 3 attempts per request (AWS_MAX_ATTEMPTS): each is answered 503 SlowDown
        endpoint = proxy.endpoint
        proc = train(tmp_path, cfg, {**s3['env'], 'S3_ENDPOINT_URL': endpoint, 'AWS_MAX_ATTEMPTS': '3'})
    assert proc.returncode == 2, f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    assert 'Traceback' not in proc.stderr, proc.stderr[-5000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith('foundrymix train: error:')]
    assert len(lines) == 1, proc.stderr[-5000:]
    m = re.fullmatch(rf'foundrymix train: error: checkpoint upload failed, the run stopped: '
                     rf's3://{BUCKET}/{prefix}{refused}: SlowDown from {re.escape(endpoint)} \(3 attempts\)'
                     rf'.*try again later or raise AWS_MAX_ATTEMPTS \(now 3\)\. Its local copy is kept: (\S+/{refused}) \(upload it there, or resume from it with '
                     rf'load_path=\1\)', lines[0])
    assert m, lines[0]
    assert proxy.counts['503'] == 3  # one request (the PutObject), 3 attempts
    kept = Path(m.group(1))
    assert same_weights(kept, straight / 'ckpt' / refused)
    # The batch-4 checkpoint and its pointer; nothing after the refused one.
    assert keys(s3, prefix) == {'ep0-ba4-rank0.pt', 'latest-rank0.pt.symlink'}
    link = s3['client'].get_object(Bucket=BUCKET, Key=prefix + 'latest-rank0.pt.symlink')['Body'].read()
    assert link.decode() == prefix + 'ep0-ba4-rank0.pt'
    assert unfinished(s3, prefix) == []
    kept.unlink()


@pytest.mark.slow  # a train.py start (the model is built before the trainer)
def test_a_store_that_never_answers_is_named_after_download_timeout(tmp_path, s3, small_streams):
    from foundrymix.s3.remote import S3Url
    from foundrymix.s3.remote import RemoteError
    from foundrymix.train.save import abort_unfinished

    accepted: list = []
    with silent_server(accepted) as hung:
        cfg = run_cfg(tmp_path, small_streams, run_name='hung', save_folder=f's3://{BUCKET}/runs/hung',
                      autoresume=True)
        cfg['train_loader']['download_timeout'] = 3
        proc = train(tmp_path, cfg, {**s3['env'], 'S3_ENDPOINT_URL': hung})
        assert len(accepted) == 1  # one attempt, which took the whole download_timeout
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert 'Traceback' not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (
            f'foundrymix train: error: autoresume: cannot read the checkpoints in s3://{BUCKET}/runs/hung: '
            f'no answer from {hung} within 3 s (download_timeout); check S3_ENDPOINT_URL, the network and '
            f'any proxy, or raise download_timeout for a slow store (check the credentials and '
            f'S3_ENDPOINT_URL, and that save_folder is right)')

        mp = pytest.MonkeyPatch()
        mp.setenv('S3_ENDPOINT_URL', hung)
        try:
            with pytest.raises(RemoteError) as e:
                abort_unfinished(S3Url(BUCKET, 'runs/hung'), 2)
        finally:
            mp.undo()
        assert len(accepted) == 2
        assert e.value.kind == 'timeout' and 'within 2 s (download_timeout)' in str(e.value)


def test_listing_at_start_outlasts_four_503s_per_request(tmp_path, s3):
    """The autoresume listing answered 503 four times (Composer's client gives up after 3)."""
    from foundrymix.train.remote_resume import remote_checkpoint

    torch.save({'state': {'model': {'w': torch.arange(10.0)}}}, tmp_path / 'c.pt')
    s3['client'].upload_file(str(tmp_path / 'c.pt'), BUCKET, 'storm/ckpts/ep0-ba5-rank0.pt')
    with FaultProxy(s3['endpoint'], error_rate=1.0, max_faults_per_request=4,
                    should_fault=lambda method, path: 'list-type=2' in path) as proxy:
        mp = pytest.MonkeyPatch()
        mp.setenv('S3_ENDPOINT_URL', proxy.endpoint)
        try:
            found = remote_checkpoint(f's3://{BUCKET}/storm/ckpts', timeout=60)
        finally:
            mp.undo()
    assert found is not None and found.path == f's3://{BUCKET}/storm/ckpts/ep0-ba5-rank0.pt'
    assert proxy.counts['503'] == 4 and proxy.counts['forward'] >= 2  # the listing, its ranged reads


def test_unfinished_uploads_of_our_names_are_aborted_at_start(s3):
    from foundrymix.s3.remote import S3Url
    from foundrymix.train.save import abort_unfinished

    ours = ['runs/mp/ckpts/ep0-ba4-rank0.pt', 'runs/mp/ckpts/latest-rank0.pt.symlink']
    others = ['runs/mp/ckpts/notes.bin', 'runs/mp/ckpts/sub/ep0-ba4-rank0.pt', 'runs/mp/ckpts-2/ep0-ba4-rank0.pt']
    for key in ours + others:
        upload = s3['client'].create_multipart_upload(Bucket=BUCKET, Key=key)
        s3['client'].upload_part(Bucket=BUCKET, Key=key, UploadId=upload['UploadId'], PartNumber=1, Body=b'x' * 100)
    assert sorted(abort_unfinished(S3Url(BUCKET, 'runs/mp/ckpts'), 10)) == sorted(ours)
    assert sorted(unfinished(s3, 'runs/mp/')) == sorted(others)
    assert abort_unfinished(S3Url(BUCKET, 'runs/mp/ckpts'), 10) == []
