"""A worker process that dies mid-conversion stops it at once, naming the chunk and the cause.

Real CLI processes with forked workers (chats and --preprocess run in processes): one worker
is SIGKILLed from outside (what the OOM killer does), or a --preprocess function calls
sys.exit, os._exit or segfaults. Before, multiprocessing.Pool replaced the dead worker and
waited for the lost chunk forever. Each case checks the exit code and the one-line message,
that nothing was published (the input directory holds exactly what it did before) and that
no worker process is left.
"""

from __future__ import annotations

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

#: seconds a conversion may take to stop once its worker died (it takes well under one)
STOP_S = 30


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
        raise AssertionError(f'the conversion did not stop within {STOP_S} s of its worker dying') from None
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == [], f'worker processes left behind: {alive}'
    return proc.returncode, err


@pytest.mark.timeout(120)
def test_sigkilled_worker_stops_the_conversion(tmp_path):
    src = tmp_path / 'chats.jsonl'
    chat_corpus(src, 12)  # 12 chunks: seconds of encoding on 2 workers
    out = tmp_path / 'out'
    proc = subprocess.Popen(convert_cmd(src, out), stderr=subprocess.PIPE, text=True)
    cli = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    # the shard writer's hidden directory appears once the workers run and results are taken
    while not any(name.startswith('.out.partial-') for name in os.listdir(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # the calling thread is now taking results, so every worker is encoding
    workers = cli.children()
    assert len(workers) == 2, workers
    victim = workers[0]
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    rc, err = finish(proc, workers)
    assert time.monotonic() - killed_at < 10, err
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


@pytest.mark.timeout(120)
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


@pytest.mark.timeout(30)
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
