"""streaming's format functions called from many threads of a fresh process at once, as the
loader's prefetch threads and its reader do when a worker opens its first shards."""

import os
import subprocess
import sys

from helpers import ROOT

RACE = '''
import threading, time
from foundrymix.format import streaming_format as sf
start, errors = threading.Barrier(8), []
def run(k):
    start.wait()
    time.sleep(0.05 * (k // 2))
    try:
        if k % 2:
            sf.get_hash("xxh64", b"abc")
        else:
            try:
                sf.ShardRows({})
            except (KeyError, TypeError, ValueError, FileNotFoundError):
                pass  # imported; the made-up shard is refused
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
'''


def test_first_use_from_many_threads_at_once_does_not_deadlock_the_import():
    """Two threads importing ``streaming`` and ``streaming.base.hashing`` at once raised
    ``_DeadlockError`` in a loader worker (4 of 5 fresh processes here, before the fix);
    three fresh processes must all read no error."""
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    for _ in range(3):
        out = subprocess.run([sys.executable, '-c', RACE], capture_output=True, text=True,
                             env=env, timeout=300)  # a guard only: the failure is an error, not a hang
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == '[]'
