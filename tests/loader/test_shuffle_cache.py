"""streaming's epoch shuffle is recorded once and re-read by a restart or resume
(``foundrymix/loader/shuffle_cache.py``): the batches are those of a run that shuffles
afresh (``FOUNDRYMIX_PLAN_CACHE=off``, streaming's own path), no shuffle is computed on a
hit, and a record that is not exactly the fresh shuffle is caught (``verify``) or, where
it is not private, never read.

Real streams (the shared small arXiv and Dolly streams), the real staged loader over two
stages (a dataset and a shuffle each), read to the end.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

GLOBAL_BATCH = 4


def two_stages(data: dict[str, str], seed: int = 5) -> dict:
    return {'streams': {'arxiv': {'local': data['arxiv']}, 'dolly': {'local': data['dolly']}},
            'shuffle_seed': seed,
            'stages': [{'name': 'pretrain', 'duration': '4ba',
                        'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.25}}},
                       {'name': 'finetune', 'duration': '3ba',
                        'streams': {'dolly': {'repeat': 1}}}]}


@pytest.fixture
def data(small_streams) -> dict[str, str]:
    return {k: str(v) for k, v in small_streams.items()}


@pytest.fixture
def shuffles(tmp_path, monkeypatch):
    """Counts the shuffles streaming computes; the records go under ``tmp_path/cache``."""
    from streaming.base.batching import random as batching
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(tmp_path / 'cache'))
    computed = []
    original = batching.get_shuffle

    @functools.wraps(original)
    def counted(*args, **kwargs):
        computed.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(batching, 'get_shuffle', counted)
    return computed


def records(tmp_path) -> list[str]:
    folder = tmp_path / 'cache' / 'shuffles'
    return sorted(n for n in os.listdir(folder) if n.endswith('.npy')) if folder.exists() else []


def batches(data: dict[str, str], monkeypatch, mode: str, at: int = 0, seed: int = 5) -> list[list[int]]:
    """Every global batch of the two-stage run (from batch ``at``), on one rank."""
    from foundrymix.loader.run_loader import build_run_loader
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.simulate import Topology
    from foundrymix.plan.stages import plan_run
    monkeypatch.setenv('FOUNDRYMIX_PLAN_CACHE', mode)
    run, _ = plan_run(LoaderConfig.from_dict(two_stages(data, seed)), GLOBAL_BATCH, None,
                      Topology(nodes=1, ranks_per_node=1))
    loader = build_run_loader(run, GLOBAL_BATCH)
    loader.position.batch = at
    try:
        return [b['sample_id'].tolist() for b in loader]
    finally:
        loader.release()


def test_a_restart_and_a_resume_read_the_shuffles_and_train_the_same_batches(
        data, tmp_path, monkeypatch, shuffles):
    fresh = batches(data, monkeypatch, 'off')
    assert len(fresh) == 7 and len(shuffles) == 2 and records(tmp_path) == []

    shuffles.clear()
    assert batches(data, monkeypatch, 'on') == fresh
    assert len(shuffles) == 2 and len(records(tmp_path)) == 2  # one per stage

    shuffles.clear()
    assert batches(data, monkeypatch, 'on') == fresh  # a restart
    assert batches(data, monkeypatch, 'on', at=2) == fresh[2:]  # a resume in stage 1
    assert batches(data, monkeypatch, 'on', at=5) == fresh[5:]  # a resume in stage 2
    assert shuffles == [] and len(records(tmp_path)) == 2

    # another seed is another shuffle: computed and recorded beside the others
    other = batches(data, monkeypatch, 'on', seed=6)
    assert other != fresh and len(shuffles) == 2 and len(records(tmp_path)) == 4
    shuffles.clear()
    assert batches(data, monkeypatch, 'verify', seed=6) == other
    assert len(shuffles) == 2  # verify shuffles afresh too, and found them equal


def test_a_changed_record_is_caught_by_verify_and_a_shared_one_is_not_read(
        data, tmp_path, monkeypatch, shuffles):
    from foundrymix.loader.shuffle_cache import ShuffleRecordMismatch
    fresh = batches(data, monkeypatch, 'on')
    folder = tmp_path / 'cache' / 'shuffles'
    # the first stage's record: written first
    path = min((folder / n for n in records(tmp_path)), key=lambda p: p.stat().st_mtime_ns)
    order = np.load(path)
    order[[0, 1]] = order[[1, 0]]
    np.save(path, order)

    with pytest.raises(ShuffleRecordMismatch, match=str(path)):
        batches(data, monkeypatch, 'verify')
    changed = batches(data, monkeypatch, 'on')  # trusted as the plan records are: read
    assert changed[:4] != fresh[:4] and changed[4:] == fresh[4:]

    os.chmod(folder, 0o770)  # writable by the group: never read
    shuffles.clear()
    assert batches(data, monkeypatch, 'on') == fresh and len(shuffles) == 2
    os.chmod(folder, 0o700)
    first_stage = shuffles[0]
    np.save(path, order[:-1])  # private, but not a shuffle of these samples: recomputed
    shuffles.clear()
    assert batches(data, monkeypatch, 'on') == fresh
    assert len(shuffles) == 1 and np.array_equal(shuffles[0][1], first_stage[1])
    np.save(path, order)
    os.chmod(path, 0o622)  # the file writable by others: never read (the other one is)
    shuffles.clear()
    assert batches(data, monkeypatch, 'on') == fresh
    assert len(shuffles) == 1 and np.array_equal(shuffles[0][1], first_stage[1])


def test_records_stay_within_their_budget(data, tmp_path, monkeypatch, shuffles):
    from foundrymix.loader import shuffle_cache
    fresh = batches(data, monkeypatch, 'on')
    sizes = sorted(os.path.getsize(tmp_path / 'cache' / 'shuffles' / n) for n in records(tmp_path))
    assert len(sizes) == 2

    # what a writer killed mid-write left: removed once an hour old, when a record is written
    folder = tmp_path / 'cache' / 'shuffles'
    old, new = folder / '.shuffles-killed.tmp', folder / '.shuffles-writing.tmp'
    old.write_bytes(b'x')
    new.write_bytes(b'x')
    os.utime(old, (old.stat().st_atime - 7200,) * 2)

    # a budget for the larger record only: the least recently used goes when one is written
    monkeypatch.setattr(shuffle_cache, 'KEEP_BYTES', sizes[1])
    assert batches(data, monkeypatch, 'on', seed=7) != fresh
    assert len(records(tmp_path)) == 1
    assert not old.exists() and new.exists()

    # a shuffle over the size limit is not recorded (and computed at every start)
    monkeypatch.setattr(shuffle_cache, 'MAX_RECORD_BYTES', 8)
    shuffles.clear()
    assert batches(data, monkeypatch, 'on', seed=8) != fresh
    assert len(records(tmp_path)) == 1 and len(shuffles) == 2


def test_every_argument_of_the_shuffle_is_in_the_record_key(tmp_path, monkeypatch):
    """Each argument of streaming's ``get_shuffle`` changed alone is another record, and
    each record read back equals streaming's own shuffle of those arguments."""
    from streaming.base.shuffle import get_shuffle

    from foundrymix.loader.shuffle_cache import ShuffleRecords
    monkeypatch.setenv('FOUNDRYMIX_PLAN_CACHE', 'on')
    base = ('py1e', np.array([13, 9, 3, 5, 2], dtype=np.int64), 1, 5, 0, 4_000_000)
    variants = [base]
    for i, other in enumerate(('py1s', np.array([13, 9, 3, 5, 3], dtype=np.int64), 2, 6, 1, 20)):
        variants.append(base[:i] + (other,) + base[i + 1:])
    expected = [get_shuffle(*v) for v in variants]
    assert all(not np.array_equal(e, expected[0]) for e in expected[1:])

    calls = []

    def compute(*args, **kwargs):
        calls.append(args)
        return get_shuffle(*args, **kwargs)

    compute.__signature__ = __import__('inspect').signature(get_shuffle)
    records = ShuffleRecords(str(tmp_path / 'cache'))
    for _ in range(2):
        for v, e in zip(variants, expected):
            got = records.shuffle(compute, *v)
            assert got.dtype == e.dtype and np.array_equal(got, e)
    assert len(calls) == len(variants)  # the second pass read every one
    assert len(os.listdir(tmp_path / 'cache' / 'shuffles')) == len(variants)
