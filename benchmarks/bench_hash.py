"""What hashing shard files at first open costs, against reading their rows.

The loader (:class:`foundrymix.loader.storage.RowStore`) hashes every shard file with the
hash ``index.json`` records (``xxh3_64``) when a process first opens it, once per file
version; later opens, in any process, only ``stat`` it. Measured here, ``--rounds`` times
(median and range), one pass over every row of ``--shards`` synthetic shards of
``--shard-mb`` MB, read by index through a fresh store each time:

* ``off``: ``hash_local_shards: false`` (no check) -- the baseline;
* ``first``: no record yet (the first run after a copy or conversion);
* ``recorded``: the records there (every later run);

each from the page cache (files read once before) and, with ``--cold``, evicted first
(``posix_fadvise(DONTNEED)``). Rounds interleave the modes (off, first, recorded, off ...)
so machine noise hits all alike; ratios are to ``off`` of the same run.

    .venv/bin/python benchmarks/bench_hash.py [--shards 5] [--shard-mb 64] [--rounds 3] [--cold]

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))


def evict(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_pass(directory: str, check: bool) -> float:
    """Seconds to read every row by index through a fresh store."""
    from foundrymix.loader.mixer import StreamMixer
    mixer = StreamMixer.from_dict({'streams': {'s': {'local': directory}}, 'hash_local_shards': check})
    start = time.perf_counter()
    store = mixer.build_store()
    for i in range(store.num_samples):
        store.get_row(i)
    store.release()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--shards', type=int, default=5)
    ap.add_argument('--shard-mb', type=int, default=64)
    ap.add_argument('--seq-len', type=int, default=2048)
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--cold', action='store_true', help='evict the files before each pass')
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix='fmx-bench-hash-')
    os.environ['FOUNDRYMIX_CACHE'] = os.path.join(root, 'cache')
    try:
        from mix_helpers import build_stream
        data = os.path.join(root, 'big')
        row_bytes = 2 * args.seq_len + 24
        build_stream(data, 'pretrain', args.shards * (args.shard_mb << 20) // row_bytes, 0, args.seq_len,
                     size_limit=args.shard_mb << 20)
        size = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))
        print(f'{args.shards} shards, {size / 1e6:.0f} MB, {"evicted" if args.cold else "page cache"}')
        times: dict[str, list[float]] = {'off': [], 'first': [], 'recorded': []}
        for _ in range(args.rounds):
            for mode in times:
                if mode == 'first':
                    shutil.rmtree(os.environ['FOUNDRYMIX_CACHE'], ignore_errors=True)
                if args.cold:
                    evict(data)
                times[mode].append(one_pass(data, mode != 'off'))
        base = statistics.median(times['off'])
        for mode, values in times.items():
            med = statistics.median(values)
            print(f'{mode:9s} {med:7.3f} s [{min(values):.3f}-{max(values):.3f}]  {med / base:.3f} x off')
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
