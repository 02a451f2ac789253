"""Live runs claim what they use (:mod:`foundrymix.claims`): a second training run into the
same ``save_folder`` and ``convert --overwrite`` of a stream directory a run reads are
refused, with real ``train.py`` / ``python -m foundrymix.cli`` processes.

The first run is kept alive with a long ``max_duration``, stopped (SIGSTOP: alive,
holding its claims, using no CPU) and killed once the second process has been refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, SAMPLES, tiny_run_config

ENV = {**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1',
       'TOKENIZERS_PARALLELISM': 'false'}


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob('*')) if p.is_file()}


def write_config(path: Path, streams: dict[str, str], **top) -> Path:
    loader = {'streams': {name: {'local': d} for name, d in streams.items()}, 'num_workers': 0}
    cfg = tiny_run_config(loader, **{'global_train_batch_size': 4, 'max_duration': '100000ba', **top})
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def start_training(cfg: Path, ready: Path) -> subprocess.Popen:
    """A live ``train.py`` run; returns once ``ready`` (a file the run writes) exists -- for a
    checkpoint, once Composer's ``latest-rank0.pt`` symlink names it: the file itself appears
    before it is whole (a run stopped then left a half-written checkpoint behind)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), str(cfg)], cwd=cfg.parent, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def done() -> bool:
        if ready.suffix != '.pt':
            return ready.exists()
        latest = ready.parent / 'latest-rank0.pt'
        return latest.is_symlink() and os.readlink(latest).endswith(ready.name)
    deadline = time.time() + 180
    while not done() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not done():
        proc.kill()
        raise AssertionError(f'the first run did not start: {proc.communicate()[1][-3000:]}')
    proc.send_signal(signal.SIGSTOP)  # stays alive (holding its claims) without using the CPU
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def convert(src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(src),
                           '--out', str(out), '--max-seq-len', '128', '--workers', '1', *extra],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)


@pytest.fixture
def paper(tmp_path) -> Path:
    """Two short arXiv texts: enough rows to train on, converted in a second."""
    import json
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        texts = [json.loads(next(f))['text'][:6000] for _ in range(2)]
    src = tmp_path / 'paper.jsonl'
    src.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts), encoding='utf-8')
    return src


@pytest.mark.slow  # two train.py processes
def test_second_run_into_a_live_runs_save_folder_is_refused(tmp_path, small_streams):
    streams = {name: str(path) for name, path in small_streams.items()}
    ckpt = tmp_path / 'ckpt'
    a = write_config(tmp_path / 'a.yaml', streams, save_folder=str(ckpt), save_interval='10ba',
                     save_overwrite=True, run_name='a')
    first = start_training(a, ckpt / 'ep0-ba10-rank0.pt')
    try:
        b_dir = tmp_path / 'b'
        b_dir.mkdir()
        b = write_config(b_dir / 'b.yaml', streams, save_folder=str(ckpt), save_interval='2ba',
                         save_overwrite=True, max_duration='4ba', run_name='b',
                         callbacks={'sample_log': {'path': str(b_dir / 'samples.jsonl')},
                                    'stream_accounting': {'out_dir': str(b_dir / 'report')}},
                         loggers={'file': {'filename': str(b_dir / 'log.txt')}})
        proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), str(b)], cwd=b_dir, env=ENV,
                              capture_output=True, text=True, timeout=300)
        before_kill = files(ckpt)
    finally:
        kill(first)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f'foundrymix train: error: save_folder: {ckpt} is in use by another live run, '
                           f'pid {first.pid}: ')
    assert 'a.yaml' in line  # the holder's command line
    assert os.listdir(b_dir) == ['b.yaml']  # no sample log, report or log file
    # every checkpoint in the folder is run A's (run name 'a'), none was touched by B
    import torch
    assert before_kill and all(
        torch.load(ckpt / name, map_location='cpu', weights_only=False)['state']['run_name'] == 'a'
        for name in before_kill if not os.path.islink(ckpt / name))


@pytest.mark.slow  # a train.py process and four conversions
def test_convert_overwrite_of_a_stream_a_live_run_reads_is_refused(tmp_path, paper):
    data = tmp_path / 'arxiv'
    assert convert(paper, data).returncode == 0
    original = files(data)
    cfg = write_config(tmp_path / 'run.yaml', {'arxiv': str(data)}, save_folder=str(tmp_path / 'ckpt'),
                       save_interval='1ba', save_num_checkpoints_to_keep=1)
    run = start_training(cfg, tmp_path / 'ckpt' / 'ep0-ba1-rank0.pt')
    try:
        refused = convert(paper, data, '--overwrite', '--no-eos')
    finally:
        if refused.returncode == 0:
            kill(run)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f'foundrymix convert: error: --out {data}: {data} is in use by a live run, pid {run.pid}: '
        f'{sys.executable} {ROOT / "train.py"} {cfg}; writing there now would corrupt what it reads. '
        f'Wait for that run to end, or choose another --out')
    assert files(data) == original
    assert run.poll() is None  # the run lives on
    kill(run)  # SIGKILL: the kernel drops its claim
    done = convert(paper, data, '--overwrite', '--no-eos')
    assert done.returncode == 0, done.stderr
    assert files(data) != original
    # and a directory no run reads is never blocked: a conversion claims and releases it
    assert convert(paper, data, '--overwrite').returncode == 0
    assert files(data) == original


def naming(path: str) -> list[str]:
    """The claim files that name ``path``: a file of its key, or this process's run file listing it (the
    run file itself stays while another test of this process still holds a claim)."""
    from foundrymix import claims
    d = Path(claims.claims_dir())
    return [n for n in os.listdir(d) if n.startswith(claims.key(path))
            or (n.startswith(f'{os.getpid()}-') and path in (d / n).read_text())]


def test_claims_are_shared_by_readers_exclusive_otherwise_and_leave_no_files(tmp_path):
    """In one process (the claim files of other processes are what the tests above use)."""
    from foundrymix import claims
    path = claims.normalize(str(tmp_path / 'd'))
    r1 = claims.try_claim(path, claims.SHARED)
    r2 = claims.try_claim(path, claims.SHARED)  # same process: one claim, counted
    assert r1.fresh and not r2.fresh
    # this process's one run file lists it: the file is where the process's first claim made it (a
    # claim another test of this process still holds may have made it under a patched tempfile.tempdir)
    run_file = Path(claims._mine.path)
    assert run_file.name.startswith(f'{os.getpid()}-') and path in run_file.read_text()
    assert len([n for n in os.listdir(claims.claims_dir()) if n.startswith(f'{os.getpid()}-')]) <= 1
    with pytest.raises(claims.Busy, match=f'{path} is in use by another live run, pid {os.getpid()}'):
        claims.try_claim(path, claims.EXCLUSIVE)
    r1.release()
    r2.release()
    assert naming(path) == []  # nothing left of it
    ex = claims.try_claim(path, claims.EXCLUSIVE)
    assert ex.fresh
    assert claims.exclusive_owner(path).pid == os.getpid()
    ex.release()
    assert claims.exclusive_owner(path) is None  # asking creates nothing either
    assert naming(path) == []
    assert not (tmp_path / 'd').exists()  # nothing is written into the claimed path


def _count_under_guard(path: str, counter: str, times: int) -> None:
    from foundrymix import claims
    for _ in range(times):
        with claims.guard(path):  # its lock file is removed on the way out, while others wait
            with open(counter) as f:
                n = int(f.read())
            os.sched_yield()
            with open(counter, 'w') as f:
                f.write(str(n + 1))


def test_the_guard_excludes_while_its_lock_file_comes_and_goes(tmp_path):
    """Four processes increment a counter under the guard, read-then-write: no increment is
    lost although every exit removes the lock file others are waiting on."""
    import multiprocessing as mp
    from foundrymix import claims
    path, counter = claims.normalize(str(tmp_path / 'd')), tmp_path / 'n'
    counter.write_text('0')
    procs = [mp.get_context('fork').Process(target=_count_under_guard, args=(path, str(counter), 50))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert counter.read_text() == '200'
    assert [p for p in os.listdir(claims.claims_dir()) if p.startswith(claims.key(path))] == []


HOLD = """
import sys, time
from foundrymix import claims
held = claims.claim_all([(p, claims.SHARED) for p in sys.argv[2:]])
open(sys.argv[1], 'w').close()
time.sleep(600)
"""


def test_another_process_claims_are_seen_while_it_lives_and_cleaned_once_it_is_killed(tmp_path):
    """A real process holds shared claims on 300 paths in one open file: an exclusive claim of
    any of them is refused naming it, the same claim succeeds once it is SIGKILLed, and its
    run file is gone (removed by that claimer)."""
    from foundrymix import claims
    paths = [claims.normalize(str(tmp_path / f'd{k}')) for k in range(300)]
    ready = tmp_path / 'ready'
    proc = subprocess.Popen([sys.executable, '-c', HOLD, str(ready), *paths], env=ENV)
    try:
        deadline = time.time() + 120
        while not ready.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        fds = os.listdir(f'/proc/{proc.pid}/fd')
        run_files = [n for n in os.listdir(claims.claims_dir()) if n.startswith(f'{proc.pid}-')]
        assert len(run_files) == 1
        assert sum(os.readlink(f'/proc/{proc.pid}/fd/{fd}').startswith(claims.claims_dir()) for fd in fds) == 1
        for path in (paths[0], paths[-1]):
            with pytest.raises(claims.Busy, match=f'{path} is in use by another live run, pid {proc.pid}: '):
                claims.try_claim(path, claims.EXCLUSIVE)
        reader = claims.try_claim(paths[5], claims.SHARED)
        assert not reader.fresh  # readers share
        reader.release()
    finally:
        proc.kill()
        proc.wait()
    got = claims.try_claim(paths[0], claims.EXCLUSIVE)
    assert got.fresh  # the killed process holds nothing
    assert run_files[0] not in os.listdir(claims.claims_dir())  # and its file was cleaned
    got.release()
