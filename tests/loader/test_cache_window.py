"""``cache_limit`` is a promise, against a real S3 endpoint (moto on 127.0.0.1, every request
seen on the wire by a relaying proxy): two remote streams of 14 and 9 shards under a limit that
holds a few shards of each -- the default window would hold them all -- are read with each shard
fetched once a pass, and every file under the cache root (shards, index files, hash records,
locks and the account) sums to at most the limit at every batch, over passes that make the
hash records compact themselves. The rows are those of the local copy in the same window."""

from __future__ import annotations

import gc
import os
from collections import Counter
from pathlib import Path

import pytest

from cache_reader import summary
from fault_proxy import FaultProxy
from foundrymix.loader.mixer import StreamMixer
from foundrymix.plan.order import WINDOW_ROWS
from foundrymix.plan.window import cache_window
from helpers import moto_s3
from mix_helpers import build_stream

BUCKET = 'fmx-window'


@pytest.fixture(scope='module')
def streams(tmp_path_factory):
    """{'a': 840 rows, 'b': 540 rows} in ~8 KiB shards, local and uploaded, behind a proxy."""
    root = tmp_path_factory.mktemp('window')
    with moto_s3(BUCKET) as s3, FaultProxy(s3['endpoint']) as proxy:
        out = {}
        for tag, (name, rows) in enumerate((('a', 840), ('b', 540))):
            d = root / name
            build_stream(str(d), 'pretrain', rows, tag, max_seq_len=48, size_limit=8 << 10)
            for f in sorted(d.iterdir()):
                s3['client'].upload_file(str(f), BUCKET, f'{name}/{f.name}')
            out[name] = {'local': str(d), 'remote': f's3://{BUCKET}/{name}'}
        yield out, proxy


def shard_files(streams) -> dict[str, int]:
    return {f'{n}/{f.name}': f.stat().st_size for n, s in streams.items()
            for f in Path(s['local']).glob('shard.*')}


def tree_bytes(root: Path) -> int:
    total = 0
    for base, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(base, name)).st_size
            except FileNotFoundError:
                pass  # evicted or renamed while we walked
    return total


def read(cfg: dict, epochs: int, cache: Path, workers: int = 0) -> tuple[dict, int]:
    """An epoch's summary (all epochs' batches) and the most bytes under ``cache`` after any batch."""
    ld = StreamMixer.from_dict(dict(cfg, num_workers=workers)).build_dataloader(batch_size=8, epochs=epochs)
    store = ld.storage
    peak = [0]

    def batches():
        for batch in ld:
            peak[0] = max(peak[0], tree_bytes(cache))
            yield batch

    class Sampled:
        def __iter__(self):
            return batches()
    got = summary(Sampled())
    del ld
    gc.collect()
    store.release()
    return got, peak[0]


@pytest.mark.parametrize('workers', [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_tight_cache_fetches_each_shard_once_a_pass_and_never_overflows(tmp_path, monkeypatch, streams,
                                                                         workers):
    data, proxy = streams
    monkeypatch.setenv('S3_ENDPOINT_URL', proxy.endpoint)
    sizes = shard_files(data)
    assert len([k for k in sizes if k.startswith('a/')]) == 14 and len(sizes) == 23
    limit = sum(sizes.values()) // 2 + (80 << 10)  # half the shards, and room for the rest
    cache = tmp_path / 'cache'
    cfg = {'streams': {n: {'remote': s['remote']} for n, s in data.items()}, 'shuffle_seed': 11,
           'cache_limit': limit, 'cache_root': str(cache)}
    window = cache_window(StreamMixer.from_dict(cfg).config, StreamMixer.from_dict(cfg).infos())
    assert 1 < window < 540 < WINDOW_ROWS  # the default window holds every shard: it would not fit
    # the plan says so (the batch size does not change the window)
    assert (f'shuffle window: {window:,} rows (the default, {WINDOW_ROWS:,}, does not fit cache_limit {limit}): '
            f'each shard is fetched about once per pass') in StreamMixer.from_dict(cfg).plan(4).notes
    del proxy.log[:]
    got, peak = read(cfg, 3, cache, workers)
    fetched = Counter(path.split(f'/{BUCKET}/', 1)[1] for method, path, _ in proxy.log
                      if method == 'GET' and '/shard.' in path)
    assert set(fetched) == set(sizes)
    # once a pass (3 passes): a shard of a window ending one pass may open the next, and with
    # two workers one a batch behind may find a shard of the window before evicted once.
    slack = 0 if workers == 0 else 1
    assert max(fetched.values()) <= 3 + slack and sum(fetched.values()) <= 3 * len(sizes) + 2 * slack * 23, fetched
    assert 0 < peak <= limit, (peak, limit)
    local = {'streams': {n: {'local': s['local']} for n, s in data.items()}, 'shuffle_seed': 11,
             'shuffle_block_size': window}
    want, _ = read(local, 3, tmp_path / 'none')
    assert got == want  # the rows, bitwise, in the order of that window


def test_a_hash_record_stays_within_the_bound_the_budget_counts(tmp_path):
    """A shard evicted and fetched again 200 times is a new file version each time (a line
    each): the record is compacted to the files present, never past ``record_bytes``."""
    import xxhash

    from foundrymix.loader.cache.hashes import ShardHashes, record_path
    from foundrymix.plan.window import RECORD_SLACK, record_bytes
    d = tmp_path / 'stream'
    d.mkdir()
    payload = {f'shard.{k:05}.mds': bytes([k]) * 1000 for k in range(3)}
    want = {n: xxhash.xxh3_64(b).hexdigest() for n, b in payload.items()}
    index = [{'samples': 1, 'raw_data': {'basename': n, 'bytes': 1000, 'hashes': {'xxh3_64': h}}}
             for n, h in want.items()]
    record = Path(record_path(str(tmp_path / 'cache'), str(d)))
    most = 0
    for k in range(200):
        name = f'shard.{k % 3:05}.mds'
        (d / name).unlink(missing_ok=True)  # evicted, fetched again: a new inode and times
        (d / name).write_bytes(payload[name])
        assert ShardHashes(str(tmp_path / 'cache')).check(str(d), name, want[name], 'xxh3_64')
        lines = record.read_text().splitlines()
        most = max(most, len(lines))
        assert record.stat().st_size <= record_bytes(index) // 2
    assert 3 + RECORD_SLACK - 5 < most <= 3 + RECORD_SLACK + 1  # it grew, then was compacted
