"""What hashing local shards at a run's start costs, against one pass of reading them.

The check (:func:`foundrymix.loader.cache.check_local_streams`, on by default) hashes every
shard file of a local stream with the hash ``index.json`` records (``xxh3_64``), once per
file version; later runs only ``stat`` the files. Measured here, per data set, ``--rounds``
times (median and range):

* ``hash cold``: no record, the files evicted from the page cache first
  (``posix_fadvise(DONTNEED)``, per file; no root needed) -- the first run after a copy;
* ``hash warm``: no record, the files in the page cache -- the first run right after
  a conversion or copy wrote them;
* ``recorded``: the records there -- every later run;
* ``bytes cold``: one ``read()`` pass over the files, evicted first (the disk's share);
* ``rows cold`` / ``rows warm``: one pass of streaming's own reader over every row
  (``streaming.LocalDataset``), what an epoch costs at least.

Data sets: the bundled samples (``data/samples``, converted with the real converters at
``--seq-len``) and ``--shards`` synthetic shards of ``--shard-mb`` MB (``ShardWriter``).

And the ranks of one node (``--ranks P``, default 2): ``--rank-streams`` stream directories
of ``--shards`` shards each, first checked (no record) by one process, then by P processes
started together as local ranks 0..P-1 (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), as a
multi-GPU node's ranks do at a run's start -- cold and warm, wall time until the last one is
done. Each rank starts at its own share of the directories and passes over those another
holds, so they hash in parallel (before, they queued on the first directory's lock).

    .venv/bin/python benchmarks/bench_hash.py [--shards 5] [--shard-mb 64] [--rounds 3]
        [--ranks 2] [--rank-streams 8]

Everything is written under a temporary directory, removed afterwards (records included:
``FOUNDRYMIX_CACHE`` points there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))


def evict(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shard_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith('.mds'))


def build_samples(root: str, seq_len: int) -> list[str]:
    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
    from helpers import SAMPLES
    arxiv, dolly = os.path.join(root, 'arxiv'), os.path.join(root, 'dolly')
    convert_pretrain([str(SAMPLES / 'arxiv_sample.jsonl')], arxiv, PretrainOptions(max_seq_len=seq_len, workers=1))
    convert_finetune([str(SAMPLES / 'dolly_hhrlhf_sample.jsonl')], dolly,
                     FinetuneOptions(max_seq_len=seq_len, workers=1))
    return [arxiv, dolly]


def build_big(root: str, shards: int, shard_mb: int, seq_len: int) -> list[str]:
    from mix_helpers import build_stream
    out = os.path.join(root, 'big')
    row_bytes = 2 * seq_len + 24  # uint16 tokens plus the span/length columns and offsets
    build_stream(out, 'pretrain', shards * (shard_mb << 20) // row_bytes, 0, seq_len,
                 size_limit=shard_mb << 20)
    return [out]


def timed(fn: Callable[[], Any], before: Callable[[], None]) -> float:
    before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, dirs: list[str], rounds: int, cache: str) -> None:
    from streaming import LocalDataset

    from foundrymix.loader.cache import check_local_streams, local_hashes
    from foundrymix.loader.mixer import StreamMixer
    config = StreamMixer.from_dict({'streams': {f's{i}': {'local': d} for i, d in enumerate(dirs)}})
    infos = config.catalog.infos()
    files = [f for d in dirs for f in shard_files(d)]
    total = sum(os.path.getsize(f) for f in files)
    records = os.path.join(cache, 'shard-hashes')

    def hash_all() -> None:
        checks = check_local_streams(config.config, infos)
        assert all(c.algorithm == 'xxh3_64' for c in checks), [c.algorithm for c in checks]

    def read_all() -> None:
        for d in dirs:
            ds = LocalDataset(local=d)
            for i in range(len(ds)):
                ds[i]

    def read_bytes() -> None:
        for f in files:
            with open(f, 'rb') as fh:
                while fh.read(1 << 24):
                    pass

    def forget() -> None:  # the records on disk and this process's memory of checked files
        shutil.rmtree(records, ignore_errors=True)
        local_hashes._SEEN.clear()

    modes = {
        'hash cold': (hash_all, lambda: (forget(), evict(files))),
        'hash warm': (hash_all, lambda: (forget(), read_bytes())),
        'recorded': (hash_all, lambda: None),
        'bytes cold': (read_bytes, lambda: evict(files)),
        'rows cold': (read_all, lambda: evict(files)),
        'rows warm': (read_all, read_bytes),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, (fn, before) in modes.items():
            times[mode].append(timed(fn, before))
    print(f'\n{name}: {len(files)} shard files, {total / 1e6:,.1f} MB; load average '
          f'{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores')
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f'  {mode:10s} median {med * 1e3:9.1f} ms  [{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}]  '
              f'{total / med / 1e9 if med else float("inf"):6.2f} GB/s')


def _rank(config: Any, infos: Any, rank: int, ranks: int, barrier: Any) -> None:
    from foundrymix.loader.cache import check_local_streams
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks))
    barrier.wait()
    check_local_streams(config, infos)


def measure_ranks(dirs: list[str], ranks: int, rounds: int, cache: str) -> None:
    """One process, then ``ranks`` processes at once, checking ``dirs`` with no record."""
    import multiprocessing

    import streaming.base.hashing  # noqa: F401  (imported in a trainer long before; 0.2 s here)

    from foundrymix.loader.cache import local_hashes
    from foundrymix.loader.mixer import StreamMixer
    config = StreamMixer.from_dict({'streams': {f's{i}': {'local': d} for i, d in enumerate(dirs)}})
    infos = config.catalog.infos()
    files = [f for d in dirs for f in shard_files(d)]
    total = sum(os.path.getsize(f) for f in files)
    ctx = multiprocessing.get_context('fork')

    def run(n: int, warm: bool) -> float:
        shutil.rmtree(os.path.join(cache, 'shard-hashes'), ignore_errors=True)
        local_hashes._SEEN.clear()
        evict(files)
        if warm:
            for f in files:
                with open(f, 'rb') as fh:
                    while fh.read(1 << 24):
                        pass
        barrier = ctx.Barrier(n + 1)
        procs = [ctx.Process(target=_rank, args=(config.config, infos, r, n, barrier)) for r in range(n)]
        for p in procs:
            p.start()
        barrier.wait()
        start = time.perf_counter()
        for p in procs:
            p.join()
            assert p.exitcode == 0, p.exitcode
        return time.perf_counter() - start

    cases = [(n, warm) for warm in (False, True) for n in (1, ranks)]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for _ in range(rounds):
        for c in cases:
            times[c].append(run(*c))
    print(f'\nranks of one node: {len(dirs)} stream directories, {len(files)} shard files, '
          f'{total / 1e6:,.1f} MB; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores')
    for warm in (False, True):
        one = statistics.median(times[(1, warm)])
        for n in (1, ranks):
            ts = times[(n, warm)]
            med = statistics.median(ts)
            print(f'  {"warm" if warm else "cold"}, {n} process(es): median {med * 1e3:8.1f} ms  '
                  f'[{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}]  {total / med / 1e9:6.2f} GB/s  '
                  f'{one / med:.2f}x one process')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--shards', type=int, default=5)
    parser.add_argument('--shard-mb', type=int, default=64)
    parser.add_argument('--seq-len', type=int, default=2048)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--ranks', type=int, default=2, help='processes of the ranks case (0: skip it)')
    parser.add_argument('--rank-streams', type=int, default=8)
    parser.add_argument('--skip-single', action='store_true', help='only the ranks case')
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix='bench-hash-')
    os.environ['FOUNDRYMIX_CACHE'] = os.path.join(root, 'cache')
    try:
        if args.ranks:
            dirs = [build_big(os.path.join(root, f'r{i}'), args.shards, args.shard_mb, args.seq_len)[0]
                    for i in range(args.rank_streams)]
            measure_ranks(dirs, args.ranks, args.rounds, os.environ['FOUNDRYMIX_CACHE'])
            for d in dirs:
                shutil.rmtree(d)
        if args.skip_single:
            return
        measure('bundled samples', build_samples(os.path.join(root, 'samples'), args.seq_len),
                args.rounds, os.environ['FOUNDRYMIX_CACHE'])
        if args.shards:
            measure(f'{args.shards} x {args.shard_mb} MB', build_big(root, args.shards, args.shard_mb,
                                                                     args.seq_len),
                    args.rounds, os.environ['FOUNDRYMIX_CACHE'])
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
    main()
