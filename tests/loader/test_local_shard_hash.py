"""A bit-flipped local shard is refused before its first row is used; verified once per file version.

Real shards from the real converter (``small_streams``, ``xxh3_64`` recorded for every
shard), real damage to their bytes: one bit of one token id flipped, the id still below
the vocabulary size -- a valid row, just the wrong one, which only the recorded hash can
tell. A shard file is hashed when a process first opens it, not at the start: the start
reads no data (a 4 TB dataset used to be read whole on every new machine). The records of
verified files (``<cache>/shard-hashes/*.log``) are read back to show what was hashed.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from foundrymix.loader.cache import CorruptLocalShardError
from foundrymix.loader.cache import hashes
from foundrymix.loader.cache.hashes import SWEPT, record_path, sweep_records
from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.config import LoaderConfig
from helpers import build_staged_loader
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


def read_all(config: dict, got: list | None = None) -> list[dict]:
    """Every batch of one epoch (batch 1); ``got`` collects them as they come."""
    got = [] if got is None else got
    loader = StreamMixer.from_dict(config).build_dataloader(batch_size=1)
    try:
        for b in loader:
            got.append({k: v.clone() for k, v in b.items()})
        return got
    finally:
        store = loader.storage
        del loader
        gc.collect()
        store.release()


def records(directory: Path) -> dict:
    """The verified-file records of ``directory``: {basename: [algo, hash, size, ...]}."""
    path = Path(record_path(None, str(directory)))
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            out[entry[0]] = entry[1:]
    return out


def recorded_hashes(stream: Path) -> dict[str, str]:
    """{shard file: its xxh3_64} as index.json records them (the independent source)."""
    return {s['raw_data']['basename']: s['raw_data']['hashes']['xxh3_64'] for s in index_of(stream)['shards']}


def error_for(stream: Path, name: str = 'arxiv', shard: str = 'shard.00001.mds') -> str:
    return (f"stream '{name}' ({stream}): shard file {shard} does not match the xxh3_64 hash its "
            f'index.json records: the bytes changed after conversion (a damaged copy or disk); no '
            f'row of it was read. Re-copy the stream from where it came from, or re-run '
            f'`foundrymix convert` into {stream} with --overwrite; `foundrymix verify {stream}` '
            f'checks every shard')


def hashed(caplog) -> list[str]:
    """Files the loader hashed, from its log lines."""
    return [Path(r.getMessage().split(' ')[1]).name for r in caplog.records
            if r.getMessage().startswith('hashing ')]


@pytest.mark.parametrize('knobs', [{}, {'validate_hash': 'xxh3_64'}], ids=['default', 'validate_hash'])
def test_flipped_token_bit_refused_before_its_first_row(arxiv, cache, knobs):
    old, new = flip_bits(arxiv, 1, 3, token=10)
    assert new < VOCAB and new != old  # a valid id: the row checks cannot see it
    got: list = []
    with pytest.raises(CorruptLocalShardError) as err:
        read_all(cfg(arxiv, **knobs), got)
    assert str(err.value) == error_for(arxiv)
    # the batches before the error are shard 0's rows (unshuffled), none of shard 1
    first_bad = first_row_of_shard(arxiv, 1)
    assert [int(b['sample_id']) for b in got] == list(range(first_bad))
    # shard 0 is recorded as verified; the damaged one is not
    want = recorded_hashes(arxiv)
    assert {b: r[1] for b, r in records(arxiv).items()} == {'shard.00000.mds': want['shard.00000.mds']}


def test_opting_out_reads_the_flipped_row(arxiv, cache):
    """``hash_local_shards: false``: the row is read as it is, and nothing recorded."""
    old, new = flip_bits(arxiv, 1, 3, token=10)
    batches = read_all(cfg(arxiv, hash_local_shards=False))
    sample = first_row_of_shard(arxiv, 1) + 3
    got = next(b for b in batches if int(b['sample_id']) == sample)
    assert int(got['input_ids'][0, 10]) == new
    assert records(arxiv) == {}


def test_a_start_reads_no_data_and_a_later_stage_stops_at_its_damaged_shard(tmp_path, small_streams,
                                                                          cache, caplog):
    """Building and preparing the run loader hashes nothing; the damaged shard of stage 2
    stops the run when stage 2 first opens it, after stage 1's batches, naming it."""
    arxiv = copy_stream(small_streams['arxiv'], tmp_path / 'arxiv')
    dolly = copy_stream(small_streams['dolly'], tmp_path / 'dolly')
    flip_bits(dolly, 0, 0, token=3)
    config = {'streams': {'arxiv': {'local': str(arxiv)}, 'dolly': {'local': str(dolly)}},
              'num_workers': 0,
              'stages': [{'name': 'pre', 'duration': '2ba', 'streams': {'arxiv': {'repeat': 1}}},
                         {'name': 'ft', 'duration': '2ba', 'streams': {'dolly': {'repeat': 1}}}]}
    caplog.set_level(logging.INFO, logger='foundrymix.loader')
    loader = build_staged_loader(LoaderConfig.from_dict(config), 2, None)
    loader.prepare()
    assert hashed(caplog) == [] and not cache.exists()
    batches = []
    with pytest.raises(CorruptLocalShardError) as err:
        for b in loader:
            batches.append(b)
    assert str(err.value) == error_for(dolly, 'dolly', 'shard.00000.mds')
    assert len(batches) == 2  # stage 1 whole
    assert set(records(arxiv)) <= set(recorded_hashes(arxiv)) and records(arxiv)
    loader.release()


def test_second_run_only_stats_and_a_changed_file_is_hashed_again(arxiv, cache, caplog):
    want = recorded_hashes(arxiv)
    sizes = {b: (arxiv / b).stat().st_size for b in want}
    rows = sum(s['samples'] for s in index_of(arxiv)['shards'])
    caplog.set_level(logging.INFO, logger='foundrymix.loader')
    assert len(read_all(cfg(arxiv))) == rows
    assert sorted(hashed(caplog)) == sorted(want)
    assert {b: r[:3] for b, r in records(arxiv).items()} == {b: ['xxh3_64', h, sizes[b]]
                                                              for b, h in want.items()}
    # A second run (a new store: a new process's view): every file recorded, none hashed.
    caplog.clear()
    assert len(read_all(cfg(arxiv))) == rows
    assert hashed(caplog) == []
    # A touched mtime: that file (only) is hashed again, and passes.
    path = shard_path(arxiv, 0)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    caplog.clear()
    assert len(read_all(cfg(arxiv))) == rows
    assert hashed(caplog) == [path.name]
    # Damage with the mtime put back (what `cp -p` of a bad copy leaves): the change time
    # still moved, so it is hashed again and refused.
    st = shard_path(arxiv, 1).stat()
    flip_bits(arxiv, 1, 3, token=10)
    os.utime(shard_path(arxiv, 1), ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CorruptLocalShardError) as err:
        read_all(cfg(arxiv))
    assert str(err.value) == error_for(arxiv)


def test_no_recorded_hashes_no_check(arxiv, cache):
    """A stream converted without hashes (older conversions): nothing to check against."""
    strip_hashes(arxiv)
    assert len(read_all(cfg(arxiv))) == sum(s['samples'] for s in index_of(arxiv)['shards'])
    assert not cache.exists() or records(arxiv) == {}


def test_a_cache_that_cannot_be_written_still_hashes(arxiv, tmp_path, monkeypatch, caplog):
    """No records (the cache path is a file): every run hashes, and a damaged shard is refused."""
    blocker = tmp_path / 'not-a-dir'
    blocker.write_text('x')
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(blocker))
    caplog.set_level(logging.INFO, logger='foundrymix.loader')
    want = recorded_hashes(arxiv)
    for _ in range(2):
        caplog.clear()
        read_all(cfg(arxiv))
        assert sorted(hashed(caplog)) == sorted(want)
    flip_bits(arxiv, 1, 3, token=10)
    with pytest.raises(CorruptLocalShardError) as err:
        read_all(cfg(arxiv))
    assert str(err.value) == error_for(arxiv)
    assert blocker.read_text() == 'x'


def _read_in_child(directory: str, barrier, out) -> None:
    passed = []  # the files this process hashed and found intact (the others it found recorded)
    want, real_hash = recorded_hashes(Path(directory)), hashes.file_hash

    def file_hash(path, size, algorithm):
        got = real_hash(path, size, algorithm)
        if got == want[Path(path).name]:
            passed.append(Path(path).name)
        return got
    hashes.file_hash = file_hash  # in this forked child only
    store = StreamMixer.from_dict(cfg(Path(directory))).build_store()
    barrier.wait()  # both start together, as the ranks of one node do
    try:
        for i in range(store.num_samples):
            store.get_row(i)
        out.put((sorted(passed), None))
    except CorruptLocalShardError as e:
        out.put((sorted(passed), str(e)))
    store.release()


@pytest.mark.parametrize('damaged', [False, True], ids=['intact', 'damaged'])
def test_processes_started_together_hash_each_file_once_and_all_refuse(arxiv, cache, damaged):
    """Two processes (forked, like two ranks of a node) read every row at once: each file is
    hashed by exactly one of them (the record's lock); a damaged file is hashed -- and
    refused -- by both, as it is never recorded."""
    if damaged:
        flip_bits(arxiv, 1, 3, token=10)
    ctx = multiprocessing.get_context('fork')
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_read_in_child, args=(str(arxiv), barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    want = sorted(recorded_hashes(arxiv))
    if not damaged:
        assert sorted(results[0][0] + results[1][0]) == want and [r[1] for r in results] == [None, None]
    else:
        assert [r[1] for r in results] == [error_for(arxiv)] * 2
        assert sorted(r[0] for r in results) and all('shard.00001.mds' not in r[0] for r in results)
        assert set(records(arxiv)) == {'shard.00000.mds'}


def test_records_unused_for_30_days_are_swept_once_a_day(arxiv, cache):
    """Records do not pile up: a run that writes a record removes those neither written nor
    used for 30 days, at most once a day; a record a run uses is marked used and stays."""
    read_all(cfg(arxiv))
    folder = cache / 'shard-hashes'
    mine = Path(record_path(None, str(arxiv)))
    assert mine.exists() and (folder / SWEPT).exists()
    old = time.time() - 31 * 86400
    for name in ('0dead.log', '1dead.json'):
        (folder / name).write_text('[]\n')
        os.utime(folder / name, (old, old))
    os.utime(mine, (old, old))
    read_all(cfg(arxiv))  # uses its record (marked used), writes nothing: no sweep
    assert mine.stat().st_mtime > time.time() - 60
    assert sweep_records(str(folder)) == 0  # swept today already
    os.utime(folder / SWEPT, (old, old))
    assert sweep_records(str(folder)) == 2
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith('.lock')) == [SWEPT, mine.name]
