"""The node-local cache of remote streams, against a real S3 endpoint (moto on 127.0.0.1).

Checked with real processes: two runs over one remote with the default cache at the same
time; a run over a user-named ``local:`` another live run holds gets an error naming the
directory; what a reader SIGKILLed mid-epoch leaves is cleaned by the next run; a ``cache_limit`` below one
shard's share and a cache disk too small (a real 256 KiB tmpfs) are refused before the
first batch, and a disk that fills mid-run names the directory and shard; ``cache_limit``
of a third of the data keeps the cache bounded through an epoch of the same rows.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cache_reader import summary
from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.window import cache_need, cache_window
from helpers import moto_s3
from mix_helpers import build_stream

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / 'tests'  # cache_reader.py and the helpers
BUCKET = 'fmx-cache'
BATCH = 4


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


def upload(s3, directory: Path, prefix: str) -> str:
    for f in sorted(directory.iterdir()):
        s3['client'].upload_file(str(f), BUCKET, f'{prefix}/{f.name}')
    return f's3://{BUCKET}/{prefix}'


@pytest.fixture(scope='module')
def small(s3, small_streams) -> dict[str, dict[str, str]]:
    """The two small streams, local and uploaded: {name: {'local': dir, 'remote': url}}."""
    return {n: {'local': str(d), 'remote': upload(s3, d, n)} for n, d in small_streams.items()}


@pytest.fixture(scope='module')
def big(s3, tmp_path_factory) -> dict[str, str]:
    """One synthetic stream of 2,000 rows in ~8 KiB shards (~250 KiB), local and uploaded."""
    d = tmp_path_factory.mktemp('big') / 'big'
    build_stream(str(d), 'pretrain', 2000, 0, max_seq_len=48, size_limit=8 << 10)
    return {'local': str(d), 'remote': upload(s3, d, 'big')}


def budget_usage(budget) -> int:
    """Bytes the budget counts now: the shards, the fetches in flight and the fixed files."""
    return budget.usage(budget._reservations())


def loader(streams: dict[str, dict[str, str]], kind: str, **extra) -> dict:
    return {'streams': {n: {kind: s[kind]} for n, s in streams.items()}, 'shuffle_seed': 11, **extra}


def local_summary(streams, batch: int = BATCH, **extra) -> dict:
    ld = StreamMixer.from_dict(loader(streams, 'local', **extra)).build_dataloader(batch_size=batch)
    ds = ld.storage
    out = summary(ld)
    del ld
    gc.collect()
    ds.release()
    return out


def reader(tmp_path: Path, name: str, s3, **spec) -> tuple[subprocess.Popen, Path]:
    """A real loader process (``cache_reader.py``) with the S3 env and the test's cache."""
    out = tmp_path / f'{name}.jsonl'
    spec = dict(spec, out=str(out), batch=BATCH)
    (tmp_path / f'{name}.json').write_text(json.dumps(spec), encoding='utf-8')
    env = dict(os.environ, **s3['env'], PYTHONPATH=f'{ROOT}{os.pathsep}{HERE}',
               FOUNDRYMIX_CACHE=str(tmp_path / 'cache'))
    with open(f'{out}.log', 'w') as log:  # a file, not a pipe: never blocks the process
        proc = subprocess.Popen([sys.executable, str(HERE / 'cache_reader.py'),
                                 str(tmp_path / f'{name}.json')], env=env, stdout=log, stderr=log,
                                start_new_session=True)
    return proc, out


def finish(proc: subprocess.Popen, out: Path) -> list[dict]:
    proc.wait(timeout=240)
    assert proc.returncode == 0, Path(f'{out}.log').read_text()[-6000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def home_dirs(tmp_path: Path, streams) -> list[str]:
    """The default-cache directory of each remote stream (what a lone run uses)."""
    from foundrymix.plan.config import LoaderConfig
    cfg = LoaderConfig.from_dict(dict(loader(streams, 'remote'), cache_root=str(tmp_path / 'cache')))
    return [cfg.stream_local(n) for n in streams]


# ------------------------------------------------------------------ two runs at once
@pytest.mark.slow
def test_two_runs_share_the_default_cache_at_once(tmp_path, s3, small):
    """4 rounds: both processes build a store over the same remotes (default cache), wait
    until the other's is built too, then read a whole epoch: each in its own directory."""
    want = local_summary(small)
    rounds = 4
    sync = tmp_path / 'sync'
    sync.mkdir()
    procs = [reader(tmp_path, me, s3, loader=loader(small, 'remote'), iterations=rounds,
                    sync={'dir': str(sync), 'me': me, 'peer': peer})
             for me, peer in (('a', 'b'), ('b', 'a'))]
    results = [finish(*p) for p in procs]
    homes = home_dirs(tmp_path, small)
    for a, b in zip(*results):
        assert a['sample_ids'] == b['sample_ids'] == want['sample_ids']
        assert a['sha256'] == b['sha256'] == want['sha256']
        for i, home in enumerate(homes):  # never one directory at once; the default and a sibling
            assert sorted([a['locals'][i], b['locals'][i]]) == [home, home + '-run2']
    assert len(want['sample_ids']) > 5 and len(results[0]) == len(results[1]) == rounds


def test_a_named_local_held_by_a_live_run_is_refused_by_name(tmp_path, s3, small):
    want = local_summary(small)
    named = {n: dict(s, local=str(tmp_path / 'mine' / n)) for n, s in small.items()}
    both = {'streams': {n: {'local': s['local'], 'remote': s['remote']} for n, s in named.items()},
            'shuffle_seed': 11}
    go = tmp_path / 'go'
    proc, out = reader(tmp_path, 'a', s3, loader=both, go=str(go))
    try:
        deadline = time.monotonic() + 120
        while not Path(str(out) + '.built').exists():
            assert proc.poll() is None and time.monotonic() < deadline, Path(f'{out}.log').read_text()
            time.sleep(0.05)
        with pytest.raises(ConfigError) as err:
            StreamMixer.from_dict(both).build_dataloader(batch_size=BATCH)
        first = list(named)[0]
        assert str(err.value).startswith(
            f"train_loader.streams.{first}.local: {named[first]['local']} is in use by another live "
            f'run, pid {proc.pid}. Two runs do not share one cache directory at once')
    finally:
        go.touch()
    got = finish(proc, out)[0]  # the holder was left alone: its epoch is whole
    assert got['sample_ids'] == want['sample_ids'] and got['sha256'] == want['sha256']
    # Once it has ended, the directory is this run's, with the shards it downloaded.
    ld = StreamMixer.from_dict(both).build_dataloader(batch_size=BATCH)
    ds = ld.storage
    assert summary(ld) == want
    del ld
    gc.collect()
    ds.release()


def exclusive_owner_seen_from_another_process(path: str) -> int:
    """The pid of the live run holding ``path`` exclusively, as a separate process sees it (0: none)."""
    code = ('import sys; from foundrymix import claims; '
            'h = claims.exclusive_owner(claims.normalize(sys.argv[1])); print(h.pid if h else 0)')
    done = subprocess.run([sys.executable, '-c', code, path], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_a_dropped_loader_gives_its_cache_directories_back(tmp_path, s3, small):
    """A loader read to its end and dropped, without release(), frees its named cache directories
    for other runs while this process lives on (as in a notebook)."""
    named = {n: str(tmp_path / 'mine' / n) for n in small}
    both = {'streams': {n: {'local': named[n], 'remote': s['remote']} for n, s in small.items()},
            'shuffle_seed': 11}
    ld = StreamMixer.from_dict(both).build_dataloader(batch_size=BATCH)
    assert summary(ld) == local_summary(small)
    assert [exclusive_owner_seen_from_another_process(d) for d in named.values()] == [os.getpid()] * len(named)
    del ld
    gc.collect()
    assert [exclusive_owner_seen_from_another_process(d) for d in named.values()] == [0] * len(named)


# ------------------------------------------------------------------ killed runs
@pytest.mark.parametrize('when', ['built', 'paused'])
def test_a_sigkilled_reader_does_not_stop_the_next_run(tmp_path, s3, small, monkeypatch, when):
    """Killed once its store is built (its directories claimed) or mid-epoch (two batches
    read, shards downloading): the next run takes the same directories, cleans the partial
    files dead runs left, and reads the same epoch."""
    want = local_summary(small)
    stop = {'built': {'go': str(tmp_path / 'never')}, 'paused': {'pause_after': 2}}[when]
    proc, out = reader(tmp_path, 'killed', s3, loader=loader(small, 'remote'), **stop)
    deadline = time.monotonic() + 120
    while not Path(f'{out}.{when}').exists():
        assert proc.poll() is None and time.monotonic() < deadline, Path(f'{out}.log').read_text()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, as a scheduler ends a job
    proc.wait()
    homes = home_dirs(tmp_path, small)
    # What a kill mid-download leaves: boto3's temporary shard and our metadata part file of a
    # dead pid; and what must stay: a live process's part file and a file no download makes.
    index = json.loads((Path(homes[0]) / 'index.json').read_text())
    shard = index['shards'][-1]['raw_data']['basename']
    live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    cache = Path(homes[0])
    planted = {'partial': cache / f'{shard}.3fA9c0d1', 'dead_part': cache / f'index.json.part-{dead.pid}',
               'live_part': cache / f'index.json.part-{live.pid}', 'other': cache / 'notes.txt'}
    try:
        for p in planted.values():
            p.write_bytes(b'x' * 100)
        monkeypatch.setenv('FOUNDRYMIX_CACHE', str(tmp_path / 'cache'))
        ld = StreamMixer.from_dict(loader(small, 'remote')).build_dataloader(batch_size=BATCH)
        ds = ld.storage
        assert [s.directory for s in ds.sources] == homes  # the same directories: nothing else holds them
        assert summary(ld) == want
        del ld
        gc.collect()
        ds.release()
        assert not planted['partial'].exists() and not planted['dead_part'].exists()
        assert planted['live_part'].exists() and planted['other'].read_bytes() == b'x' * 100
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------------ space
def test_cache_limit_below_what_the_loader_needs_is_refused(tmp_path, big):
    """Below a shard being read, room to fetch three more and the fixed files: refused in one
    line naming the largest shard and the minimum -- which is then accepted, and one byte less not."""
    import re
    streams = {'big': big}
    index = json.loads((Path(big['local']) / 'index.json').read_text())
    largest = max(s['raw_data']['bytes'] for s in index['shards'])
    name = next(s['raw_data']['basename'] for s in index['shards'] if s['raw_data']['bytes'] == largest)
    limit = 4 * largest - 1  # streaming's minimum, which did not count the files beside the shards
    cfg = loader(streams, 'remote', cache_limit=limit, cache_root=str(tmp_path / 'c'))
    with pytest.raises(ConfigError) as err:
        StreamMixer.from_dict(cfg).build_dataloader(batch_size=BATCH)
    text = str(err.value)
    minimum = int(re.search(r'Raise cache_limit to at least ([\d,]+),', text).group(1).replace(',', ''))
    assert text == (
        f'train_loader.cache_limit: {limit:,} bytes is below what the loader needs to read these '
        f'streams, {minimum:,} bytes: a shard of each of the 1 remote stream(s) at once ({largest:,} '
        f"bytes), room to fetch 3 more of the largest ({largest:,} bytes, stream 'big', {name}) and the "
        f'index and hash-record files ({minimum - 4 * largest:,} bytes). Raise cache_limit to at least '
        f'{minimum:,}, or convert with a smaller --size-limit')
    assert 4 * largest < minimum < 4 * largest + (96 << 10)
    with pytest.raises(ConfigError, match='is below what the loader needs'):
        StreamMixer.from_dict(dict(cfg, cache_limit=minimum - 1)).build_store()
    StreamMixer.from_dict(dict(cfg, cache_limit=minimum)).build_store().release()


def test_cache_limit_with_a_local_only_stream_is_refused_and_its_files_kept(tmp_path, big):
    """The budget evicts the coldest shard of any stream to honour cache_limit: a stream
    with no remote would lose its own shard files. Refused before anything is read."""
    copy = tmp_path / 'mine'
    shutil.copytree(big['local'], copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    cfg = loader({'mine': {'local': str(copy)}}, 'local', cache_limit='1gb')
    with pytest.raises(ConfigError, match=r"train_loader.cache_limit: stream\(s\) mine have no "
                                          r'remote, and the loader would evict -- delete -- their'):
        StreamMixer.from_dict(cfg).build_dataloader(batch_size=BATCH)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before


def test_cache_limit_reads_through_evictions_in_process(tmp_path, big):
    """Rows read by index (no DataLoader worker) from a remote under the smallest
    ``cache_limit``: every shard comes in, older ones are evicted, the rows are the local
    copy's, and what the budget counts covers every file under the cache root."""
    import numpy as np
    from foundrymix.plan.window import cache_need
    cfg = loader({'big': big}, 'remote', cache_root=str(tmp_path / 'c'))
    limit = cache_need(StreamMixer.from_dict(cfg).infos())(1)
    ds = StreamMixer.from_dict(dict(cfg, cache_limit=limit)).build_store()
    ref = StreamMixer.from_dict(loader({'big': big}, 'local')).build_store()
    index = json.loads((Path(big['local']) / 'index.json').read_text())
    try:
        ids = list(range(0, ds.num_samples, 97))
        for i in ids:
            assert np.array_equal(ds[i]['input_ids'], ref[i]['input_ids']), i
        cache = Path(ds.sources[0].directory)
        on_disk = sum(f.stat().st_size for f in (tmp_path / 'c').rglob('*') if f.is_file())
        shards = {s['raw_data']['basename'] for s in index['shards']}
        assert on_disk <= budget_usage(ds.budget) <= limit
        assert 0 < len(shards & {f.name for f in cache.iterdir()}) < len(shards)  # some evicted
    finally:
        ds.release()
        ref.release()


@pytest.mark.slow
def test_cache_limit_keeps_the_cache_bounded_through_an_epoch(tmp_path, big):
    streams = {'big': big}
    total = sum(f.stat().st_size for f in Path(big['local']).glob('shard.*'))
    infos = StreamMixer.from_dict(loader(streams, 'remote', cache_root=str(tmp_path / 'c'))).infos()
    limit = max(total // 3, cache_need(infos)(1))  # a third of the shards, or the least the loader needs
    assert limit < total // 2  # evictions, many
    cfg = loader(streams, 'remote', cache_limit=limit, cache_root=str(tmp_path / 'c'))
    window = cache_window(StreamMixer.from_dict(cfg).config, StreamMixer.from_dict(cfg).infos())
    want = local_summary(streams, batch=16, shuffle_block_size=window)  # the order in that window
    ld = StreamMixer.from_dict(cfg).build_dataloader(batch_size=16)
    ds = ld.storage
    cache = Path(ds.sources[0].directory)
    peak, seen, stop = [0], set(), threading.Event()

    def poll():  # every file of the cache but our manifest, partial downloads too
        while not stop.is_set():
            before = sorted(os.listdir(cache))
            size = 0
            for name in before:
                if name != 'foundrymix.json':
                    try:
                        size += os.stat(cache / name).st_size
                    except FileNotFoundError:
                        pass
            # A snapshot only if no file came or went meanwhile (a listing is not atomic: it
            # could count a shard being evicted and the one downloaded in its place).
            if sorted(os.listdir(cache)) == before:
                peak[0] = max(peak[0], size)
                seen.update(before)
            time.sleep(0.002)

    t = threading.Thread(target=poll)
    t.start()
    try:
        got = summary(ld)
    finally:
        stop.set()
        t.join()
    usage = budget_usage(ds.budget)
    del ld
    gc.collect()
    ds.release()
    assert got == want  # the same rows, in the same order, bitwise
    shards = {f.name for f in Path(big['local']).glob('shard.*')}
    assert shards <= seen  # every shard came through the cache during the epoch...
    assert len(shards & set(os.listdir(cache))) < len(shards)  # ...and some were evicted
    assert limit // 2 < peak[0] <= limit and usage <= limit, (peak[0], limit, usage)


def run_in_small_fs(tmp_path: Path, s3, size: str, script: str) -> str:
    """``script`` in a process whose ``tmp_path/small`` is a fresh tmpfs of ``size``."""
    small_fs = tmp_path / 'small'
    small_fs.mkdir()
    (tmp_path / 'script.py').write_text(script, encoding='utf-8')
    env = dict(os.environ, **s3['env'], PYTHONPATH=f'{ROOT}{os.pathsep}{HERE}')
    user = [] if os.geteuid() == 0 else ['--user', '--map-root-user']
    inner = f'mount -t tmpfs -o size={size} tmpfs {small_fs} && exec {sys.executable} {tmp_path / "script.py"}'
    proc = subprocess.run(['unshare', *user, '--mount', '--propagation', 'private', 'sh', '-c', inner],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.skipif(shutil.which('unshare') is None, reason='needs unshare for a private small tmpfs')
def test_cache_disk_too_small_is_refused_before_the_first_batch(tmp_path, s3, big):
    """A real 256 KiB tmpfs as cache_root: refused up front without a cache_limit; with
    one that fits, the run starts, and when the disk then fills (a file written meanwhile)
    the shard download fails naming the directory and the shard."""
    script = f"""
import json, os
from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
root = {str(tmp_path / 'small')!r}
cfg = {{'streams': {{'big': {{'remote': {big['remote']!r}}}}}, 'cache_root': root}}
out = {{}}
try:
    StreamMixer.from_dict(cfg).build_dataloader(batch_size=4)
except ConfigError as e:
    out['refused'] = str(e)
ld = StreamMixer.from_dict(dict(cfg, cache_limit=96 << 10)).build_dataloader(batch_size=4)
free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
with open(os.path.join(root, 'filler'), 'wb') as f:
    f.write(b'x' * (free - (2 << 10)))
try:
    for _ in ld:
        pass
except Exception as e:
    out['failed'] = type(e).__name__ + ': ' + str(e)
out['free'] = free
print(json.dumps(out))
"""
    out = json.loads(run_in_small_fs(tmp_path, s3, '256k', script).strip().splitlines()[-1])
    total = sum(f.stat().st_size for f in Path(big['local']).glob('shard.*'))
    directory = str(tmp_path / 'small' / StreamMixer.from_dict(
        {'streams': {'big': {'remote': big['remote']}}, 'cache_root': str(tmp_path / 'small')}
    ).config.stream_local('big').rsplit('/', 1)[1])
    refused = out['refused']
    assert refused.startswith(f'train_loader: the cache directory {directory} has ')
    assert f'bytes free, and this run downloads {total:,} bytes into it (shards not cached yet of ' \
           f"stream 'big' ({total:,} bytes)). Free space there, set train_loader.cache_limit" in refused
    failed = out['failed']
    assert directory in failed and 'shard.' in failed and 'No space left on device' in failed
    assert 'the cache disk is full' in failed and 'cache_limit' in failed


@pytest.mark.slow
def test_a_sigkilled_convert_does_not_stop_the_next_one(tmp_path, arxiv_jsonl):
    """``foundrymix convert`` killed (its process group) once it has written shards into its
    partial directory: the same command then completes, the dead run's partial directory
    is gone, and the output equals a conversion that was never interrupted."""
    from convert_helpers import read_rows
    big = tmp_path / 'big.jsonl'
    big.write_bytes(arxiv_jsonl.read_bytes())
    out = tmp_path / 'out'
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(big), '-o', str(out),
           '--max-seq-len', '128', '--workers', '1', '--no-progress', '--size-limit', '8kb']
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith('.out.partial-') and any(p.glob('shard.*'))
                  for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, 'finished before it was killed'
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(p.name.startswith('.out.partial-') for p in tmp_path.iterdir())  # what it left
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ['big.jsonl', 'out']
    ref = tmp_path / 'ref'
    subprocess.run([*cmd[:cmd.index('-o') + 1], str(ref), *cmd[cmd.index('-o') + 2:]], env=env,
                   check=True, capture_output=True, timeout=240)
    def plain(d):
        return [{k: v.tolist() if hasattr(v, 'tolist') else v for k, v in r.items()} for r in read_rows(d)]
    rows = plain(out)
    assert len(rows) > 50 and rows == plain(ref)
