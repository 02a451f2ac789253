"""A pre-empted run with ``save_folder: s3://...`` (moto's server on 127.0.0.1) resumes when the
same command runs again.

The killed run saves every 5 batches of 20. Its batch-15 checkpoint upload is held in flight by
a proxy (read whole, never answered) -- the moment a pre-emption usually hits -- and the trainer
then gets a real SIGKILL, or SIGTERM and SIGKILL 10 s later (a scheduler's grace period): the
bucket holds the batch-5 and batch-10 checkpoints, not the batch-15 one (whether
``latest-rank0.pt.symlink`` is there does not matter: autoresume lists the checkpoints).
Checked: nothing the killed trainer started still runs (no process left in its working
directory); the same command resumes from batch 10, ends with exit 0, and ``foundrymix
compare`` finds its sample log, accounting and final weights equal to a straight run's; a newer
checkpoint object that is not a whole checkpoint is passed over, named, and rewritten; a third
start of the finished run exits 0 saying so and changes nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from fault_proxy import FaultProxy
from helpers import ROOT, moto_s3, tiny_run_config

BUCKET = 'fmx-preempt'
BATCH = 6
N_BATCHES = 20
HELD_BATCH = 15  # the checkpoint whose upload is in flight when the run is killed


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


def run_cfg(tmp: Path, streams: dict, **top) -> dict:
    data = {'streams': {'arxiv': {'local': str(streams['arxiv']), 'repeat': 1.5},
                        'dolly': {'local': str(streams['dolly'])}},
            'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0}
    return tiny_run_config(data, global_train_batch_size=BATCH, max_duration=f'{N_BATCHES}ba',
                           save_interval='5ba', log_interval='5ba',
                           scheduler={'name': 'cosine_with_warmup', 't_warmup': '2ba', 'alpha_f': 0.1},
                           callbacks={'sample_log': {'path': str(tmp / 'samples.jsonl')},
                                      'stream_accounting': {'out_dir': str(tmp / 'report')}},
                           **top)


def run_env(env: dict) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith('AWS_') and k != 'S3_ENDPOINT_URL'}
    out.update(env)
    return out


def train(cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), 'c.yaml'], cwd=cwd, env=run_env(env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    return proc


def sample_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keys(s3, prefix: str) -> dict[str, int]:
    listed = s3['client'].list_objects_v2(Bucket=BUCKET, Prefix=prefix).get('Contents', [])
    return {o['Key'][len(prefix):]: o['Size'] for o in listed}


def left_in(directory: Path) -> list[psutil.Process]:
    """Live processes whose working directory is ``directory`` (a killed run's children inherit it)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.cwd() == str(directory) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope='module')
def straight(tmp_path_factory, small_streams, s3):
    """The uninterrupted run, checkpoints in a local folder."""
    d = tmp_path_factory.mktemp('straight')
    (d / 'c.yaml').write_text(yaml.safe_dump(run_cfg(d, small_streams, run_name='straight',
                                                     save_folder=str(d / 'ckpt'))))
    train(d, s3['env'])
    assert [b['batch'] for b in sample_log(d / 'samples.jsonl')] == list(range(N_BATCHES))
    return d


def name(straight: Path, batch: int) -> str:
    """The checkpoint file name of ``batch`` (its epoch as the straight run counted it)."""
    found = [p.name for p in (straight / 'ckpt').glob(f'ep*-ba{batch}-rank0.pt')]
    assert len(found) == 1, found
    return found[0]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location='cpu', weights_only=False)['state']['model']


@pytest.mark.slow  # three whole train.py runs (and the straight one)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM], ids=['sigkill', 'sigterm'])
def test_preempted_s3_run_resumes_to_the_straight_run(tmp_path, s3, small_streams, straight, sig):
    run_name = f'pre-{sig.name.lower()}'
    prefix = f'runs/{run_name}/ckpts/'
    save = f's3://{BUCKET}/{prefix.rstrip("/")}'
    job = tmp_path / 'job'
    job.mkdir()
    (job / 'c.yaml').write_text(yaml.safe_dump(run_cfg(job, small_streams, run_name=run_name,
                                                       save_folder=save, autoresume=True)))

    held, ba5, ba10, last = (name(straight, b) for b in (HELD_BATCH, 5, 10, N_BATCHES))
    with FaultProxy(s3['endpoint'], hold=lambda method, path: method == 'PUT' and path.endswith(held)) as proxy:
        env = {**s3['env'], 'S3_ENDPOINT_URL': proxy.endpoint}
        proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), 'c.yaml'], cwd=job,
                                env=run_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 600
        while not proxy.held.wait(0.05) and proc.poll() is None and time.time() < deadline:
            pass
        assert proxy.held.is_set(), (f'the batch-15 upload never came (exit {proc.poll()}): {proxy.log}\n'
                                     f'{proc.stderr.read()[-3000:]}')
        proc.send_signal(sig)
        try:  # a pre-emption notice: SIGKILL after a grace period, as schedulers do (theirs are
            proc.wait(timeout=10)  # 30 s or more; the held upload outlasts any of them)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        # Composer's engine turns SIGTERM into sys.exit(128 + 15); its exit then waits for the
        # held upload, so the grace period usually ends in SIGKILL.
        assert proc.returncode in ((-9,) if sig == signal.SIGKILL else (128 + 15, -9))
        # Nothing the trainer started runs on. (multiprocessing's resource tracker, which
        # streaming's shared memory starts, exits by itself when it reads EOF from the dead
        # trainer's pipe: waited for, with a bound far above that, not timed.)
        _, alive = psutil.wait_procs(left_in(job), timeout=60)
        left = [' '.join(p.cmdline())[:200] for p in alive]
        for p in alive:  # (those processes are the test's own: end them, then fail)
            p.kill()
        assert not left, f'{len(left)} processes of the killed run still run: {left}'
        in_bucket = keys(s3, prefix)
        assert {ba5, ba10} <= set(in_bucket) and held not in in_bucket, in_bucket
        killed_at = len(sample_log(job / 'samples.jsonl'))
        assert 15 <= killed_at <= N_BATCHES

    if sig == signal.SIGTERM:
        # A newer object that is not a whole checkpoint (a store that shows objects before they
        # are complete, a copy cut short): the first half of the batch-10 one, named batch 15.
        body = s3['client'].get_object(Bucket=BUCKET, Key=prefix + ba10)['Body'].read()
        s3['client'].put_object(Bucket=BUCKET, Key=prefix + held, Body=body[:len(body) // 2])

    # The same command again: it resumes from the newest whole checkpoint in the bucket.
    out = train(job, s3['env'])
    assert f'resumed from {save}/{ba10} at batch 10 (epoch 0, batch 10 of it)' in out.stdout, out.stdout[-3000:]
    if sig == signal.SIGTERM:
        assert re.search(rf'autoresume: {re.escape(save)}/{held} is incomplete \(.*\) .*left in place, '
                         rf'resuming from the newest complete checkpoint {re.escape(save)}/{ba10}',
                         out.stdout), out.stdout[-3000:]
    in_bucket = keys(s3, prefix)
    assert {ba5, ba10, held, last} <= set(in_bucket), in_bucket
    link = s3['client'].get_object(Bucket=BUCKET, Key=prefix + 'latest-rank0.pt.symlink')['Body'].read()
    assert link.decode() == prefix + last
    assert left_in(job) == []

    # Bitwise the straight run: sample log, accounting and final weights (`foundrymix compare`),
    # and the rewritten batch-15 checkpoint too.
    ckpts = job / 'ckpt'
    ckpts.mkdir()
    for n in (held, last):
        s3['client'].download_file(BUCKET, prefix + n, str(ckpts / n))
    compare = subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'compare', str(straight), str(job),
                              '--checkpoint-b', str(ckpts / last)],
                             capture_output=True, text=True, env=run_env({}))
    assert compare.returncode == 0, compare.stdout + compare.stderr
    assert compare.stdout.splitlines()[0] == (f'samples:    equal ({N_BATCHES} batches, '
                                              f'{N_BATCHES * BATCH} samples)')
    got, want = weights(ckpts / held), weights(straight / 'ckpt' / held)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)

    # Once more, after the run finished: it says so and exits 0; nothing is trained or written.
    before = keys(s3, prefix)
    log_before = (job / 'samples.jsonl').read_text()
    out = train(job, s3['env'])
    assert (f'already finished: {save}/{last} is at batch {N_BATCHES}, the end of max_duration '
            f'{N_BATCHES}ba; nothing to train') in out.stdout, out.stdout[-3000:]
    assert keys(s3, prefix) == before
    assert (job / 'samples.jsonl').read_text() == log_before


def test_remote_checkpoint_is_the_newest_whole_object(s3, tmp_path):
    """Without training: which object autoresume takes, and the refusal when none is whole."""
    from foundrymix.errors import UserError
    from foundrymix.train.remote_resume import remote_checkpoint

    torch.save({'state': {'model': {'w': torch.arange(1000.0)}}}, tmp_path / 'c.pt')
    whole = (tmp_path / 'c.pt').read_bytes()
    put = lambda key, body: s3['client'].put_object(Bucket=BUCKET, Key=key, Body=body)  # noqa: E731
    for key, body in (('ep0-ba5-rank0.pt', whole), ('ep0-ba10-rank0.pt', whole),
                      ('ep1-ba15-rank0.pt', whole[:-30]),           # cut short: no end of the zip
                      ('ep1-ba12-rank0.pt', b''),                    # empty
                      ('ep2-ba30-rank0.pt.tmp', whole),              # not a checkpoint's name
                      ('sub/ep3-ba40-rank0.pt', whole),              # below the folder
                      ('latest-rank0.pt.symlink', b'unit/ckpts/ep0-ba5-rank0.pt')):  # stale
        put(f'unit/ckpts/{key}', body)
    put('unit/ckpts-other/ep9-ba90-rank0.pt', whole)                 # a sibling prefix
    found = remote_checkpoint(f's3://{BUCKET}/unit/ckpts')
    assert found.path == f's3://{BUCKET}/unit/ckpts/ep0-ba10-rank0.pt'
    assert [(uri.rsplit('/', 1)[1], reason.split(':')[0]) for uri, reason in found.skipped] == [
        ('ep1-ba15-rank0.pt', 'BadZipFile'), ('ep1-ba12-rank0.pt', 'BadZipFile')]

    assert remote_checkpoint(f's3://{BUCKET}/unit/none') is None
    put('unit/cut/ep0-ba5-rank0.pt', whole[:len(whole) // 2])
    with pytest.raises(UserError) as e:
        remote_checkpoint(f's3://{BUCKET}/unit/cut/')
    assert str(e.value).startswith(f'autoresume: no complete checkpoint in s3://{BUCKET}/unit/cut/: '
                                   f's3://{BUCKET}/unit/cut/ep0-ba5-rank0.pt incomplete (BadZipFile')
    assert 'autoresume=false save_overwrite=true' in str(e.value)
