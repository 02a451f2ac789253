"""A worker process that dies mid-conversion stops it at once, naming the chunk and the cause.

Real CLI processes with forked workers (chats and --preprocess run in processes): one worker
is SIGKILLed from outside (what the OOM killer does), or a --preprocess function calls
sys.exit, os._exit or segfaults. Before, multiprocessing.Pool replaced the dead worker and
waited for the lost chunk forever. Each case checks the exit code and the one-line message,
that nothing was published (the input directory holds exactly what it did before) and that
no worker process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import SAMPLES

#: a hang guard, not a speed claim: the old code waited for a dead worker's chunk forever,
#: so any finite wait tells the two apart; generous so that a loaded machine never trips it
STOP_S = 240


def chat_corpus(path, megabytes: float) -> None:
    """Dolly/HH examples as user/assistant chats, numbered by ``n``, up to ``megabytes``."""
    pairs = [json.loads(line) for line in open(SAMPLES / 'dolly_hhrlhf_sample.jsonl', encoding='utf-8')]
    n = 0
    with open(path, 'w', encoding='utf-8') as f:
        while f.tell() < megabytes * 1e6:
            for p in pairs:
                f.write(json.dumps({'n': n, 'messages': [{'role': 'user', 'content': p['prompt']},
                                                         {'role': 'assistant', 'content': p['response']}]})
                        + '\n')
                n += 1


def convert_cmd(src, out, *extra) -> list[str]:
    return [sys.executable, '-m', 'foundrymix.cli', 'convert', 'finetune', str(src), '-o', str(out),
            '--workers', '2', '--parallel', 'processes', '--max-seq-len', '512', '--no-progress', *extra]


def finish(proc: subprocess.Popen, workers: list[psutil.Process]) -> tuple[int, str]:
    """The CLI's exit code and stderr, once it stopped (within STOP_S); then no worker is left."""
    try:
        _, err = proc.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f'the conversion was still running {STOP_S} s after its worker died '
                             f'(waiting for the lost chunk?)') from None
    _, alive = psutil.wait_procs(workers, timeout=60)
    assert alive == [], f'worker processes left behind: {alive}'
    return proc.returncode, err


def busy(worker: psutil.Process) -> bool:
    """Whether ``worker`` uses CPU over a short look (an idle worker waits on its task queue)."""
    before = sum(worker.cpu_times()[:2])
    time.sleep(0.2)
    return sum(worker.cpu_times()[:2]) > before


@pytest.mark.timeout(600)
def test_sigkilled_worker_stops_the_conversion(tmp_path):
    src = tmp_path / 'chats.jsonl'
    chat_corpus(src, 12)  # 12 chunks: seconds of encoding on 2 workers
    out = tmp_path / 'out'
    proc = subprocess.Popen(convert_cmd(src, out), stderr=subprocess.PIPE, text=True)
    cli = psutil.Process(proc.pid)
    deadline = time.monotonic() + 300  # a hang guard (start-up and imports, loaded machine)
    # the shard writer's hidden directory appears once the workers run and results are taken
    while not any(name.startswith('.out.partial-') for name in os.listdir(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    workers = cli.children()
    assert len(workers) == 2, workers
    while not all(busy(w) for w in workers):  # both mid-chunk: using CPU (an idle one sleeps)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    victim = workers[0]
    victim.send_signal(signal.SIGKILL)
    rc, err = finish(proc, workers)
    assert rc == 2, err
    m = re.fullmatch(rf'foundrymix convert: error: worker process {victim.pid} for {re.escape(str(src))} '
                     r'bytes (\d+)-(\d+) was killed by SIGKILL \(out of memory\? fewer --workers need less '
                     r'memory\); the conversion was stopped\n', err)
    assert m, err
    start, end = map(int, m.groups())
    with open(src, 'rb') as f:  # a real chunk: whole lines
        assert start == 0 or f.read()[start - 1:start] == b'\n'
    assert start < end <= src.stat().st_size
    assert sorted(os.listdir(tmp_path)) == ['chats.jsonl']


PREPROCESS = '''
import ctypes
import os
import sys


def exit3(rec):
    if rec['n'] == 100:
        sys.exit(3)
    return rec


def os_exit4(rec):
    if rec['n'] == 100:
        os._exit(4)
    return rec


def segfault(rec):
    if rec['n'] == 100:
        ctypes.string_at(0)
    return rec
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize('func, how', [
    ('exit3', 'exited with code 3 (sys.exit or os._exit, e.g. in a --preprocess function?)'),
    ('os_exit4', 'exited with code 4 (sys.exit or os._exit, e.g. in a --preprocess function?)'),
    ('segfault', 'was killed by SIGSEGV (a crash in native code, e.g. one a --preprocess function calls?)'),
])
def test_preprocess_that_ends_its_worker_stops_the_conversion(tmp_path, func, how):
    (tmp_path / 'prep.py').write_text(PREPROCESS)
    src = tmp_path / 'chats.jsonl'
    chat_corpus(src, 0.5)  # one chunk: record n=100 is in it
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.Popen(convert_cmd(src, tmp_path / 'out', '--preprocess', f'prep:{func}'),
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    workers = []
    while proc.poll() is None and len(workers) < 2:  # to check that none is left
        try:
            workers = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    rc, err = finish(proc, workers)
    assert rc == 2, err
    assert re.fullmatch(rf'foundrymix convert: error: worker process \d+ for {re.escape(str(src))} bytes '
                        rf'0-{src.stat().st_size} {re.escape(how)}; the conversion was stopped\n', err), err
    assert sorted(os.listdir(tmp_path)) == before


def _failing_init() -> None:
    raise OSError('tokenizer file vanished')


@pytest.mark.timeout(300)  # a hang guard: the old code waited forever
def test_worker_whose_initializer_fails_stops_the_conversion():
    """multiprocessing.Pool restarted such a worker over and over and waited forever."""
    from foundrymix.convert.pipeline import ordered_map
    from foundrymix.convert.readers import Chunk
    chunks = [Chunk('jsonl', f'c{i}') for i in range(4)]
    before = {p.pid for p in psutil.Process().children()}  # earlier tests' helpers (in one suite)
    with pytest.raises(OSError, match='^tokenizer file vanished$'):
        with ordered_map(bool, chunks, 2, _failing_init, (), mode='processes') as results:
            list(results)
    assert [p for p in psutil.Process().children() if p.pid not in before] == []


HANG = '''
import os
import time


def hang(rec):
    if rec['n'] == 100 and os.environ.get('FMX_TEST_HANG'):
        open(f'hanging-{os.getpid()}', 'w').close()
        time.sleep(3600)
    return rec
'''


@pytest.mark.slow  # two CLI conversions, one SIGKILLed
@pytest.mark.timeout(600)
def test_workers_die_with_a_sigkilled_conversion_and_the_rerun_is_not_refused(tmp_path):
    """SIGKILL of the CLI process while a worker is mid-chunk (a --preprocess function that
    hangs, standing for a long chunk): its workers are gone as soon as it is, so the rerun
    right after gets the --out claim. Before, a busy worker ran on holding the claim (the
    flock it inherited) and the rerun was refused naming the dead pid."""
    (tmp_path / 'prep.py').write_text(HANG)
    src = tmp_path / 'chats.jsonl'
    chat_corpus(src, 0.5)  # one chunk: record n=100 is in it
    out = tmp_path / 'out'
    cmd = convert_cmd(src, out, '--preprocess', 'prep:hang')
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, 'FMX_TEST_HANG': '1'})
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300  # a hang guard (start-up and imports, loaded machine)
        while not any(n.startswith('hanging-') for n in os.listdir(tmp_path)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children()
        hanging = int(next(n for n in os.listdir(tmp_path) if n.startswith('hanging-'))[len('hanging-'):])
        assert hanging in [w.pid for w in workers] and len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        rerun = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert rerun.returncode == 0, rerun.stderr
        assert json.loads((out / 'foundrymix.json').read_text())['counts']['documents_read'] == \
            sum(1 for _ in open(src, encoding='utf-8'))
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert alive == [], f'worker processes outlived their SIGKILLed parent: {alive}'
    finally:
        for w in workers:  # what this test started, should the check above have failed
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()
