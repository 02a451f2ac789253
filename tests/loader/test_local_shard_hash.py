"""A bit-flipped local shard is refused before its first row, by default; verified once per file version.

Real shards from the real converter (``small_streams``, ``xxh3_64`` recorded for every
shard), real damage to their bytes: one bit of one token id flipped, the id still below
the vocabulary size -- a valid row, just the wrong one, which only the recorded hash can
tell. Before: ``StreamMixer`` and the run loader read it without a word, with
``validate_hash: xxh3_64`` set or not (streaming 0.13 hashes only what it downloads or
decompresses). The records of verified files (``<cache>/shard-hashes/``) are read back
to show what was hashed; the hashed bytes are checked against the files' sizes.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

import pytest

from foundrymix.loader.cache import CorruptLocalShardError, check_local_shards
from foundrymix.loader.cache.local_hashes import record_path
from foundrymix.loader.mixer import StreamMixer
from foundrymix.loader.run_loader import build_staged_loader
from foundrymix.plan.config import LoaderConfig
from integrity_helpers import copy_stream, first_row_of_shard, flip_bits, index_of, shard_path, strip_hashes

VOCAB = 8192  # the bundled foundrymix-bpe-8k


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own foundrymix cache directory (where the records go)."""
    root = tmp_path / 'fm-cache'
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(root))
    return root


@pytest.fixture
def arxiv(tmp_path, small_streams) -> Path:
    return copy_stream(small_streams['arxiv'], tmp_path / 'arxiv')


def cfg(path: Path, **extra) -> dict:
    return {'streams': {'arxiv': {'local': str(path)}}, 'shuffle': False, 'num_workers': 0, **extra}


def read_all(config: dict) -> list[dict]:
    loader = StreamMixer.from_dict(config).build_dataloader(batch_size=1)
    try:
        return [{k: v.clone() for k, v in b.items()} for b in loader]
    finally:
        dataset = loader.storage
        del loader
        gc.collect()
        dataset.release()


def records(directory: Path) -> dict:
    """The verified-file records of ``directory``: {basename: [algo, hash, size, ...]}."""
    path = Path(record_path(None, str(directory)))
    return json.loads(path.read_text())['files'] if path.exists() else {}


def recorded_hashes(stream: Path) -> dict[str, str]:
    """{shard file: its xxh3_64} as index.json records them (the independent source)."""
    return {s['raw_data']['basename']: s['raw_data']['hashes']['xxh3_64'] for s in index_of(stream)['shards']}


def error_for(stream: Path, name: str = 'arxiv', shards: str = 'shard.00001.mds') -> str:
    return (f"stream '{name}' ({stream}): shard file(s) {shards} do not match the xxh3_64 hash its "
            f'index.json records: the bytes changed after conversion (a damaged copy or disk); no '
            f'row of it was read. Re-copy the stream from where it came from, or re-run '
            f'`foundrymix convert` into {stream} with --overwrite; `foundrymix verify {stream}` '
            f'checks every shard')


@pytest.mark.parametrize('knobs', [{}, {'validate_hash': 'xxh3_64'}], ids=['default', 'validate_hash'])
def test_flipped_token_bit_refused_before_any_batch(arxiv, cache, knobs):
    old, new = flip_bits(arxiv, 1, 3, token=10)
    assert new < VOCAB and new != old  # a valid id: the row checks cannot see it
    with pytest.raises(CorruptLocalShardError) as err:
        read_all(cfg(arxiv, **knobs))
    assert str(err.value) == error_for(arxiv)
    # the good shards are recorded as verified; the damaged one is not
    want = recorded_hashes(arxiv)
    assert {b: r[1] for b, r in records(arxiv).items()} == {b: h for b, h in want.items()
                                                            if b != 'shard.00001.mds'}


def test_opting_out_reads_the_flipped_row(arxiv, cache):
    """``hash_local_shards: false``: the old behaviour (the row is read), and nothing recorded."""
    old, new = flip_bits(arxiv, 1, 3, token=10)
    batches = read_all(cfg(arxiv, hash_local_shards=False))
    sample = first_row_of_shard(arxiv, 1) + 3
    got = next(b for b in batches if int(b['sample_id']) == sample)
    assert int(got['input_ids'][0, 10]) == new
    assert records(arxiv) == {} and not cache.exists()


def test_run_start_refuses_a_damaged_shard_of_a_later_stage(tmp_path, small_streams, cache):
    """The run loader checks every stage's local streams when it is built, not when the
    stage starts: nothing was iterated, no dataset was built."""
    arxiv = copy_stream(small_streams['arxiv'], tmp_path / 'arxiv')
    dolly = copy_stream(small_streams['dolly'], tmp_path / 'dolly')
    flip_bits(dolly, 0, 0, token=3)
    config = {'streams': {'arxiv': {'local': str(arxiv)}, 'dolly': {'local': str(dolly)}},
              'num_workers': 0,
              'stages': [{'name': 'pre', 'duration': '2ba', 'streams': {'arxiv': {'repeat': 1}}},
                         {'name': 'ft', 'duration': '2ba', 'streams': {'dolly': {'repeat': 1}}}]}
    with pytest.raises(CorruptLocalShardError) as err:
        build_staged_loader(LoaderConfig.from_dict(config), 2, None)
    assert str(err.value) == error_for(dolly, 'dolly', 'shard.00000.mds')
    assert set(records(arxiv)) == set(recorded_hashes(arxiv))  # stage 1's stream: verified


def test_second_build_only_stats_and_a_changed_file_is_hashed_again(arxiv, cache, caplog):
    index = index_of(arxiv)
    config = LoaderConfig.from_dict(cfg(arxiv))
    want = recorded_hashes(arxiv)
    sizes = {b: (arxiv / b).stat().st_size for b in want}

    with caplog.at_level(logging.INFO, logger='foundrymix.loader.cache.local_hashes'):
        first = check_local_shards('arxiv', str(arxiv), index, config)
    assert [r.getMessage() for r in caplog.records if 'local shard file(s)' in r.getMessage()][0] == (
        f"stream 'arxiv': hashing {len(want)} local shard file(s), {sum(sizes.values()):,} bytes "
        f'(xxh3_64; once per file version; hash_local_shards: false skips it)')
    caplog.clear()
    assert (first.algorithm, sorted(first.hashed_files), first.hashed_bytes, first.recorded_files) == (
        'xxh3_64', sorted(want), sum(sizes.values()), 0)
    assert {b: r[:3] for b, r in records(arxiv).items()} == {b: ['xxh3_64', h, sizes[b]]
                                                              for b, h in want.items()}

    # A build of the loader: every file recorded, nothing hashed (its log line says so).
    with caplog.at_level(logging.INFO, logger='foundrymix.loader.cache.local_hashes'):
        assert len(read_all(cfg(arxiv))) == sum(s['samples'] for s in index['shards'])
    assert [r for r in caplog.records if 'local shard file(s)' in r.getMessage()] == []
    again = check_local_shards('arxiv', str(arxiv), index, config)
    assert (again.hashed_files, again.hashed_bytes, again.recorded_files) == ([], 0, len(want))

    # A touched mtime: that file (only) is hashed again, and passes.
    path = shard_path(arxiv, 0)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    touched = check_local_shards('arxiv', str(arxiv), index, config)
    assert (touched.hashed_files, touched.hashed_bytes) == ([path.name], sizes[path.name])

    # Damage with the mtime put back (what `cp -p` or rsync of a bad copy leaves): the
    # change time still moved, so it is hashed again and refused.
    st = shard_path(arxiv, 1).stat()
    flip_bits(arxiv, 1, 3, token=10)
    os.utime(shard_path(arxiv, 1), ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard_path(arxiv, 1).stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(CorruptLocalShardError) as err:
        check_local_shards('arxiv', str(arxiv), index, config)
    assert str(err.value) == error_for(arxiv)


def test_no_recorded_hashes_no_check(arxiv, cache):
    """A stream converted without hashes (older conversions): nothing to check against."""
    strip_hashes(arxiv)
    result = check_local_shards('arxiv', str(arxiv), index_of(arxiv), LoaderConfig.from_dict(cfg(arxiv)))
    assert (result.algorithm, result.hashed_files) == (None, [])
    assert not cache.exists()


def test_a_cache_that_cannot_be_written_still_hashes(arxiv, tmp_path, monkeypatch, caplog):
    """No records (the cache path is a file): every run hashes, and a damaged shard is refused."""
    blocker = tmp_path / 'not-a-dir'
    blocker.write_text('x')
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(blocker))
    config = LoaderConfig.from_dict(cfg(arxiv))
    want = recorded_hashes(arxiv)
    for _ in range(2):
        result = check_local_shards('arxiv', str(arxiv), index_of(arxiv), config)
        assert (sorted(result.hashed_files), result.recorded_files) == (sorted(want), 0)
    assert 'every run hashes them' in caplog.text
    flip_bits(arxiv, 1, 3, token=10)
    with pytest.raises(CorruptLocalShardError) as err:
        check_local_shards('arxiv', str(arxiv), index_of(arxiv), config)
    assert str(err.value) == error_for(arxiv)
    assert blocker.read_text() == 'x'


def _check_in_child(directory: str, barrier, out) -> None:
    config = LoaderConfig.from_dict(cfg(Path(directory)))
    barrier.wait()  # both start together, as the ranks of one node do
    try:
        result = check_local_shards('arxiv', directory, index_of(Path(directory)), config)
        out.put((sorted(result.hashed_files), result.recorded_files, None))
    except CorruptLocalShardError as e:
        out.put((None, None, str(e)))


@pytest.mark.parametrize('damaged', [False, True], ids=['intact', 'damaged'])
def test_ranks_started_together_hash_once_and_all_refuse(arxiv, cache, damaged):
    """Two processes (forked, like two ranks of a node) check at once: the lock makes one hash
    every file and the other only stat; a damaged file is hashed -- and refused -- by both.
    The test holds the directory's lock while they start (as a rank still hashing would), so
    both are waiting when it is released: neither finishes before."""
    import multiprocessing
    import queue

    from foundrymix.loader.cache.local_hashes import _locked
    if damaged:
        flip_bits(arxiv, 1, 3, token=10)
    want = sorted(recorded_hashes(arxiv))
    ctx = multiprocessing.get_context('fork')
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_check_in_child, args=(str(arxiv), barrier, out), daemon=True)
             for _ in range(2)]
    for p in procs:
        p.start()  # before the lock is taken: a forked child would inherit it
    with _locked(record_path(None, str(arxiv))):
        barrier.wait()
        with pytest.raises(queue.Empty):
            out.get(timeout=1.0)  # both wait on the lock
    results = sorted((out.get(timeout=60) for _ in procs), key=repr)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    if damaged:
        assert results == [(None, None, error_for(arxiv))] * 2
    else:
        assert sorted(results, key=lambda r: r[1]) == [(want, 0, None), ([], len(want), None)]


def test_second_check_in_one_process_only_stats(arxiv, cache):
    """A run checks every stream at its start and again as it builds the dataset: the
    second check in the same process takes no lock and reads no record (it is gone here:
    the original code hashed every file again) -- until a file changes."""
    index = index_of(arxiv)
    config = LoaderConfig.from_dict(cfg(arxiv))
    want = recorded_hashes(arxiv)
    first = check_local_shards('arxiv', str(arxiv), index, config)
    assert (sorted(first.hashed_files), first.recorded_files) == (sorted(want), 0)
    record = Path(record_path(None, str(arxiv)))
    record.unlink()
    again = check_local_shards('arxiv', str(arxiv), index, config)
    assert (again.hashed_files, again.recorded_files) == ([], len(want))
    assert not record.exists()
    st = shard_path(arxiv, 1).stat()
    flip_bits(arxiv, 1, 3, token=10)
    os.utime(shard_path(arxiv, 1), ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CorruptLocalShardError) as err:
        check_local_shards('arxiv', str(arxiv), index, config)
    assert str(err.value) == error_for(arxiv)


def test_a_run_reads_one_record_for_all_its_streams(tmp_path, small_streams, cache, monkeypatch):
    """A run over many local streams checks them against one record of its set of
    directories (issue 22: a lock and a record read per directory were 0.17 s of a
    1,000-stream start): in the next process every stream only ``stat`` s, even with each
    directory's own record gone (the original code hashed every file again) -- and a file
    damaged since, its mtime put back, is still hashed and refused."""
    from foundrymix.loader.cache import check_local_streams
    from foundrymix.loader.cache import local_hashes
    from foundrymix.plan.catalog import Catalog
    streams = {n: copy_stream(small_streams[s], tmp_path / n)
               for n, s in (('a', 'arxiv'), ('b', 'dolly'), ('c', 'arxiv'))}
    config = LoaderConfig.from_dict({'streams': {n: {'local': str(p)} for n, p in streams.items()}})
    infos = Catalog(config).infos()
    want = {n: sorted(recorded_hashes(p)) for n, p in streams.items()}

    first = check_local_streams(config, infos)
    assert {i.name: (sorted(r.hashed_files), r.recorded_files) for i, r in zip(infos, first)} == {
        n: (files, 0) for n, files in want.items()}
    for p in streams.values():
        Path(record_path(None, str(p))).unlink()

    monkeypatch.setattr(local_hashes, '_SEEN', {})  # a new process
    again = check_local_streams(config, infos)
    assert {i.name: (r.hashed_files, r.recorded_files) for i, r in zip(infos, again)} == {
        n: ([], len(files)) for n, files in want.items()}
    assert not any(Path(record_path(None, str(p))).exists() for p in streams.values())

    st = shard_path(streams['b'], 1).stat()
    flip_bits(streams['b'], 1, 3, token=10)
    os.utime(shard_path(streams['b'], 1), ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(local_hashes, '_SEEN', {})
    with pytest.raises(CorruptLocalShardError) as err:
        check_local_streams(config, infos)
    assert str(err.value) == error_for(streams['b'], name='b')


def test_records_unused_for_30_days_are_swept_once_a_day(tmp_path, small_streams, cache, monkeypatch):
    """Records do not pile up: a start that writes a record removes those neither written nor
    used for 30 days (with their locks; not one a process holds), at most once a day. A
    record a start uses is marked used, so it stays. The original code removed nothing (this
    machine's shared cache: 63,606 files after a few days of tests)."""
    import fcntl
    import time
    from foundrymix.loader.cache import check_local_streams
    from foundrymix.loader.cache import local_hashes
    from foundrymix.loader.cache.local_hashes import SWEPT, set_record_path, sweep_records
    from foundrymix.plan.catalog import Catalog

    def run(*names: str) -> list:
        config = LoaderConfig.from_dict({'streams': {n: {'local': str(streams[n])} for n in names}})
        monkeypatch.setattr(local_hashes, '_SEEN', {})  # a new process
        return check_local_streams(config, Catalog(config).infos())

    streams = {n: copy_stream(small_streams[s], tmp_path / n) for n, s in (('a', 'arxiv'), ('b', 'dolly'))}
    run('a')
    folder = cache / 'shard-hashes'
    kept = {p.name for p in folder.iterdir()}
    assert kept == {Path(record_path(None, str(streams['a']))).name,
                    Path(record_path(None, str(streams['a']))).name + '.lock',
                    Path(set_record_path(None, [str(streams['a'])])).name, SWEPT}
    # what dead directories leave behind: a record with its lock, a set record, a killed
    # writer's temporary file, each 31 days old; and one old record whose lock is held
    old = time.time() - 31 * 86400
    dead = {'0dead.json': '{}', '0dead.json.lock': '', 'set-0dead.json': '{}',
            '1held.json': '{}', '1held.json.lock': '', 'set-2.json.part-99': '{'}
    for name, text in dead.items():
        (folder / name).write_text(text)
        os.utime(folder / name, (old, old))
    a_set = Path(set_record_path(None, [str(streams['a'])]))
    os.utime(a_set, (old, old))  # a record as old, but used below: stays
    held = os.open(folder / '1held.json.lock', os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        again = run('a')  # uses a's set record: nothing hashed, the record marked used
        assert (again[0].hashed_files, again[0].recorded_files) == ([], len(recorded_hashes(streams['a'])))
        assert a_set.stat().st_mtime > time.time() - 60
        run('a', 'b')  # a new set record: a start that writes sweeps -- but it swept today
        assert set(dead) <= {p.name for p in folder.iterdir()}
        os.utime(folder / SWEPT, (old, old))  # the last sweep a day ago
        run('b')  # writes b's set record, and sweeps
        left = {p.name for p in folder.iterdir()}
        assert left & set(dead) == {'1held.json', '1held.json.lock'}
        assert kept <= left and a_set.exists()
        assert sweep_records(str(folder)) == 0  # once a day
    finally:
        os.close(held)
    assert sweep_records(str(folder), now=time.time() + 86400) == 1  # no longer held: 1held
    assert not (folder / '1held.json').exists() and not (folder / '1held.json.lock').exists()


def _streams_config(tmp_path: Path, small_streams, n: int) -> tuple[LoaderConfig, dict[str, Path]]:
    streams = {f's{i}': copy_stream(small_streams['arxiv'], tmp_path / f's{i}') for i in range(n)}
    return LoaderConfig.from_dict({'streams': {k: {'local': str(p)} for k, p in streams.items()}}), streams


def _check_streams_in_child(config, barrier, out, env) -> None:
    from foundrymix.loader.cache import check_local_streams
    from foundrymix.plan.catalog import Catalog
    os.environ.update(env)
    infos = Catalog(config).infos()
    barrier.wait()
    results = check_local_streams(config, infos)
    out.put((env.get('LOCAL_RANK'), [(i.name, sorted(r.hashed_files), r.recorded_files)
                                     for i, r in zip(infos, results)]))


def test_a_rank_passes_over_a_directory_another_rank_is_hashing(tmp_path, small_streams, cache):
    """The ranks of a node hash in parallel (issue 22): a directory whose lock another
    process holds (it is hashing it) is passed over, the others hashed, and it is waited
    for last -- then only its record is read. Here the test holds the first directory's
    lock: the other two are hashed and recorded while it does (the original code waited on
    the first directory and hashed nothing until it was released); once released, the
    first is hashed too (the test recorded nothing), and the results are in config order."""
    import multiprocessing

    from foundrymix.loader.cache.local_hashes import _locked
    config, streams = _streams_config(tmp_path, small_streams, 3)
    want = sorted(recorded_hashes(streams['s0']))
    ctx = multiprocessing.get_context('fork')
    barrier, out = ctx.Barrier(2), ctx.Queue()
    child = ctx.Process(target=_check_streams_in_child, args=(config, barrier, out, {}), daemon=True)
    child.start()  # before the lock is taken: a forked child would inherit it
    with _locked(record_path(None, str(streams['s0']))):
        barrier.wait()
        deadline = time.monotonic() + 60
        while not (records(streams['s1']) and records(streams['s2'])) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(records(streams['s1'])) == want and sorted(records(streams['s2'])) == want
        assert records(streams['s0']) == {} and child.is_alive()  # s0: still waited for
    _, results = out.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert results == [(name, want, 0) for name in ('s0', 's1', 's2')]
    assert sorted(records(streams['s0'])) == want


def test_each_rank_of_a_node_starts_at_its_own_share(tmp_path, small_streams, cache, monkeypatch, caplog):
    """Local rank r of w (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) starts hashing at directory
    r * n / w and wraps around, so the ranks of a node begin on different directories."""
    from foundrymix.loader.cache import check_local_streams
    from foundrymix.plan.catalog import Catalog
    config, _ = _streams_config(tmp_path, small_streams, 4)
    infos = Catalog(config).infos()
    monkeypatch.setenv('LOCAL_RANK', '1')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '2')
    with caplog.at_level(logging.INFO, logger='foundrymix.loader.cache.local_hashes'):
        check_local_streams(config, infos)
    order = [r.getMessage().split("'")[1] for r in caplog.records if ': hashing ' in r.getMessage()]
    assert order == ['s2', 's3', 's0', 's1']


def test_two_ranks_started_together_hash_every_directory_once(tmp_path, small_streams, cache):
    """Two processes (local ranks 0 and 1 of 2) check four directories at once: between them
    every shard file is hashed exactly once, and each ends with every directory verified,
    in config order."""
    import multiprocessing
    config, streams = _streams_config(tmp_path, small_streams, 4)
    want = sorted(recorded_hashes(streams['s0']))
    ctx = multiprocessing.get_context('fork')
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_check_streams_in_child, daemon=True,
                         args=(config, barrier, out, {'LOCAL_RANK': str(r), 'LOCAL_WORLD_SIZE': '2'}))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    names = sorted(streams)
    for rank in ('0', '1'):
        got = results[rank]
        assert [name for name, _, _ in got] == names
        # each directory: hashed here (every file) or verified by the other rank (every file recorded)
        assert all((files, n) in ((want, 0), ([], len(want))) for _, files, n in got)
    hashed_by = [[rank for rank in ('0', '1') if results[rank][k][1]] for k in range(len(names))]
    assert all(len(who) == 1 for who in hashed_by), hashed_by
