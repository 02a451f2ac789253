"""Two ranks of a job agree on streaming's shared-memory prefix while other jobs on the
machine register and release theirs (``streaming_compat.ranks_take_leaders_prefix``).

The failure (CI, streaming 0.13): ``shared memory prefix=N was not registered by local
leader`` at a 2-rank start, with other jobs building datasets beside it. Every rank
scanned ``/dev/shm`` for the first free prefix on its own; only the local leader holds
foundrymix's registration lock, so a non-leader could scan while another job held a
prefix and its leader after that job had released it.

Made to happen on every try: this process holds the registration lock (as another job's
leader does while it registers) and a live dataset's prefix; the leader of the 2-rank job
waits for the lock, and the non-leader builds its loader until it sleeps without using CPU
for 1 s (blocked on its leader, :func:`waits_for_another_rank`) -- whatever it picked by
then, it picked while the prefix was taken. Then the dataset is released and the lock let
go, and the leader scans. On the original code the non-leader then died with the CI's
error on every try; the fix makes it take its leader's prefix. Real processes (gloo), the
real staged loader over two stages (a dataset each), read to the end and compared with one
rank's batches.

No other job is needed either: a job's own leader unlinking a released dataset's prefix
while another rank scans for the next dataset (a stage switch) did the same
(:func:`test_two_ranks_build_datasets_back_to_back`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import ROOT, free_port

GLOBAL_BATCH = 4

CHILD = textwrap.dedent('''
    import json, os, sys
    import torch.distributed as dist
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.topology import Topology
    from foundrymix.plan.stages import plan_run
    from foundrymix.loader.run_loader import build_run_loader
    job = json.loads(open(sys.argv[1]).read())
    rank = int(os.environ['RANK'])
    dist.init_process_group(job['backend'])  # as Composer's Trainer does before later stages
    run, _ = plan_run(LoaderConfig.from_dict(job['config']), job['global_batch'] // 2, None,
                      Topology(nodes=1, ranks_per_node=2))
    if rank == 1:
        open(job['building'], 'a').close()
    loader = build_run_loader(run, job['global_batch'] // 2)
    batches, prefixes = [], []
    for b in loader:
        batches.append(b['sample_id'].tolist())
        prefixes.append(loader._active.dataset._shm_prefix_int)
    loader.release()
    with open(job['out'].format(rank=rank), 'w') as f:
        json.dump({'batches': batches, 'prefixes': prefixes}, f)
''')


def two_stages(data: dict[str, str]) -> dict:
    return {'streams': {'arxiv': {'local': data['arxiv']}, 'dolly': {'local': data['dolly']}},
            'shuffle_seed': 5,
            'stages': [{'name': 'pretrain', 'duration': '3ba',
                        'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.25}}},
                       {'name': 'finetune', 'duration': '2ba',
                        'streams': {'dolly': {'repeat': 1}}}]}


@pytest.fixture(scope='module')
def data(small_streams) -> dict[str, str]:
    return {k: str(v) for k, v in small_streams.items()}


@pytest.fixture(scope='module')
def one_rank(data) -> list[list[int]]:
    """The global batches of the run on one rank (in this process)."""
    from foundrymix.loader.run_loader import build_run_loader
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.topology import Topology
    from foundrymix.plan.stages import plan_run
    run, _ = plan_run(LoaderConfig.from_dict(two_stages(data)), GLOBAL_BATCH, None,
                      Topology(nodes=1, ranks_per_node=1))
    loader = build_run_loader(run, GLOBAL_BATCH)
    batches = [b['sample_id'].tolist() for b in loader]
    loader.release()
    return batches


def start_rank(rank: int, tmp_path: Path, port: str, *argv: str) -> subprocess.Popen:
    """Rank ``rank`` of a 2-rank job on this node: ``python -c argv[0] argv[1:]``."""
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')]),
           'TMPDIR': str(tmp_path / 'tmpdir'), 'RANK': str(rank), 'LOCAL_RANK': str(rank),
           'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': port}
    return subprocess.Popen([sys.executable, '-c', *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def waits_for_another_rank(proc: subprocess.Popen, building: Path, limit: float = 60) -> bool:
    """Whether ``proc``, once it started building its loader (``building`` exists), went to
    sleep without using CPU for 1 s: blocked on its leader, whatever it decided before."""
    deadline, last, still = time.monotonic() + limit, None, 0
    while still < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if not building.exists():
            continue
        with open(f'/proc/{proc.pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
        state, cpu = fields[0], int(fields[11]) + int(fields[12])  # utime + stime
        still = still + 1 if state == 'S' and cpu == last else 0
        last = cpu
    return still >= 5


def another_jobs_dataset(directory: str, tmp: Path, monkeypatch):
    """A live dataset of another job, with the job's ``TMPDIR`` (jobs on one machine share
    ``/tmp``, whose streaming filelocks the prefix scan skips): its prefix is the one the
    job would pick, and is taken while it lives."""
    import tempfile

    from streaming import Stream

    from foundrymix.loader.dataset import MixedDataset
    with monkeypatch.context() as m:
        m.setattr(tempfile, 'tempdir', str(tmp))
        return MixedDataset(stream_names=['other'], streams=[Stream(local=directory)], batch_size=1)


def test_two_ranks_agree_while_another_job_releases_its_prefix(tmp_path, data, one_rank, monkeypatch):
    from foundrymix.loader.cache import registering_prefix

    (tmp_path / 'tmpdir').mkdir()
    building = tmp_path / 'rank1-builds'
    job = tmp_path / 'job.json'
    job.write_text(json.dumps({'config': two_stages(data), 'global_batch': GLOBAL_BATCH,
                               'backend': 'gloo', 'building': str(building),
                               'out': str(tmp_path / 'rank{rank}.json')}))
    port = str(free_port())
    other = another_jobs_dataset(data['arxiv'], tmp_path / 'tmpdir', monkeypatch)
    procs = []
    try:
        with registering_prefix():
            for rank in range(2):
                procs.append(start_rank(rank, tmp_path, port, CHILD, str(job)))
            assert waits_for_another_rank(procs[1], building), \
                f'rank 1 never waited for rank 0 (exit code {procs[1].poll()})'
            other.release()  # the other job ends: its prefix is free again ...
        # ... and the registration lock is let go: rank 0 takes it and scans now
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        other.release()
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f'rank {r} (exit code {p.returncode}):\n{err[-2000:]}'
              for r, (p, (_, err)) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, '\n'.join(failed)
    ranks = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in range(2)]
    assert ranks[0]['prefixes'] == ranks[1]['prefixes']
    assert len(set(ranks[0]['prefixes'][:3])) == 1 and len(ranks[0]['prefixes']) == 5
    assert len(one_rank) == 5
    for k, batch in enumerate(one_rank):
        assert sorted(ranks[0]['batches'][k] + ranks[1]['batches'][k]) == sorted(batch), k


REFUSED = textwrap.dedent('''
    import os, sys
    import torch.distributed as dist
    dist.init_process_group('gloo')
    from streaming import Stream
    from foundrymix.loader.dataset import MixedDataset
    try:
        MixedDataset(stream_names=['a'], streams=[Stream(remote=sys.argv[1], local=sys.argv[2])],
                     batch_size=1)
    except ValueError as e:
        print(str(e).split('. Provide')[0])
        sys.exit(3)
''')


def test_a_refused_directory_stops_every_rank(tmp_path, data, monkeypatch):
    """Only the leader scans now, so only it finds that another live dataset registers the
    cache directory of a remote stream: the other rank must raise it too, not wait for a
    leader that failed (streaming's ``Reused local directory``; the loader turns it into
    a ``ConfigError``)."""
    (tmp_path / 'tmpdir').mkdir()
    cache = str(tmp_path / 'cache')
    with monkeypatch.context() as m:
        import tempfile

        from streaming import Stream

        from foundrymix.loader.dataset import MixedDataset
        m.setattr(tempfile, 'tempdir', str(tmp_path / 'tmpdir'))
        other = MixedDataset(stream_names=['other'], streams=[Stream(remote=data['arxiv'], local=cache)],
                             batch_size=1)
    port = str(free_port())
    procs = []
    try:
        for rank in range(2):
            procs.append(start_rank(rank, tmp_path, port, REFUSED, data['arxiv'], cache))
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        other.release()
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert (p.returncode, out.strip()) == (3, f'Reused local directory: {[cache]} vs {[cache]}'), \
            f'rank {rank}: {err[-2000:]}'


BACK_TO_BACK = textwrap.dedent('''
    import json, os, sys
    import torch.distributed as dist
    dist.init_process_group('gloo')
    from streaming import Stream
    from foundrymix.loader.dataset import MixedDataset
    prefixes = []
    for _ in range(int(sys.argv[2])):
        d = MixedDataset(stream_names=['a'], streams=[Stream(local=sys.argv[1])], batch_size=1)
        prefixes.append(d._shm_prefix_int)
        d.release()  # what a stage switch does before it builds the next stage's dataset
    print(json.dumps(prefixes))
''')


def test_two_ranks_build_datasets_back_to_back(tmp_path, data):
    """No other job at all: the leader unlinks a released dataset's prefix while the other
    rank may already scan for the next one (a stage switch). The original code failed
    here on 13 tries of 13 on this machine, at the second dataset (``prefix=1 was not
    registered by local leader``); with 4 datasets instead of 10, on 1 try of 4."""
    (tmp_path / 'tmpdir').mkdir()
    port = str(free_port())
    procs = []
    for rank in range(2):
        procs.append(start_rank(rank, tmp_path, port, BACK_TO_BACK, data['arxiv'], '10'))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f'rank {r} (exit code {p.returncode}):\n{err[-2000:]}'
              for r, (p, (_, err)) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, '\n'.join(failed)
    prefixes = [json.loads(out) for out, _ in outs]
    assert prefixes[0] == prefixes[1] and len(prefixes[0]) == 10


def test_the_prefix_scan_lists_the_filelocks_once_and_picks_streamings_prefix(tmp_path, monkeypatch):
    """streaming leaves ``<tmp>/NNNNNN_barrier_filelock`` and ``_cache_filelock`` for every
    dataset that ever ran and tests them at every prefix, once per segment name (9): at
    least 6,300 ``stat`` s to walk past 700 dead prefixes here. ``prefix_scan_skips_locked`` lists the directory
    once and hands the scan only the prefixes without a filelock: the chosen prefix is the
    one streaming's own scan chooses (run here unchanged as the oracle), no filelock of a
    dead prefix is tested, and a filelock made after the listing still counts."""
    import tempfile

    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, SHM_TO_CLEAN
    from streaming.base.shared import prefix

    from foundrymix.loader import streaming_compat
    tmp = tmp_path / 'tmp'
    tmp.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp))
    dead = set(range(2000)) - {700, 701}  # two freed prefixes: their segments may be live
    for p in dead:
        for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
            (tmp / prefix._get_path(p, name)).touch()
    (tmp / '0000042_barrier_filelock').touch()  # not streaming's spelling of prefix 42
    (tmp / f'{prefix._get_path(3, "barrier_filelock")}.bak').touch()

    tested: list[str] = []
    exists = os.path.exists

    def counted(path):
        if str(path).endswith('_filelock'):
            tested.append(os.path.basename(path))
        return exists(path)

    def scan() -> int:
        tested.clear()
        with monkeypatch.context() as m:
            m.setattr(os.path, 'exists', counted)
            return max(prefix._check_and_find_retrying([str(tmp_path / 'mine')], [None], name, 0)
                       for name in SHM_TO_CLEAN)

    oracle = scan()
    # streaming's own scan: every segment name walks past at least the 700 dead prefixes
    # below the first freed one (``any`` stops at the first filelock found)
    assert oracle >= 700 and len(tested) >= 9 * 700
    with streaming_compat.prefix_scan_skips_locked():
        chosen = scan()
    assert chosen == oracle >= 700
    dead_tested = [n for n in tested if int(n.split('_')[0]) in dead]
    assert dead_tested == []
    assert len(tested) <= 9 * 2 * (oracle - len(dead & set(range(oracle))) + 1)

    # A filelock made after the listing (another dataset registering meanwhile) is seen.
    with streaming_compat.prefix_scan_skips_locked():
        assert scan() == chosen  # the listing is made by the first scan
        (tmp / prefix._get_path(chosen, CACHE_FILELOCK)).touch()
        after = scan()
    assert after == scan() > chosen  # == streaming's own choice now
