"""Tokens/s of one epoch read from S3 with a cold cache, from the warm local cache, and cold
through a fault-injecting proxy (503 SlowDown on a share of requests).

The endpoint is moto's S3 server on 127.0.0.1 (loopback: no network latency or bandwidth
limit, so the cold figure measures the client path -- HTTP, botocore, streaming's download
threads, file writes -- not a cloud link). The corpus is synthetic, written by the real
``ShardWriter`` with the converter's default shard size (64 MB): a pretrain stream and a
packed finetune stream of ``--seq-len`` token rows, uploaded whole to the bucket.

Each repeat runs, in this order, so machine noise hits all alike:

* ``cold``: a fresh cache directory; metadata and every shard come over HTTP;
* ``warm``: the cache the cold read just filled (same config, nothing is downloaded);
* ``faults``: a fresh cache, through :class:`tests.fault_proxy.FaultProxy` answering
  ``--error-rate`` of the requests with ``503 SlowDown`` (botocore retries them, counted).

A read's time runs from building the loader (the metadata fetch included) to its last
batch. Prints each read, then per mode the median tokens/s of ``--repeats`` (range in
brackets) and its ratio to the warm-cache median of the same run.

    .venv/bin/python benchmarks/bench_s3.py [--rows 40000] [--seq-len 2048] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))

from fault_proxy import FaultProxy  # noqa: E402
from helpers import moto_s3  # noqa: E402
import mix_helpers  # noqa: E402

from foundrymix.s3 import retries as s3_retries  # noqa: E402
from foundrymix.loader.mixer import StreamMixer  # noqa: E402

BUCKET = 'fmx-bench'
SHARD = 64 << 20  # the converter's default size_limit ('64mb')


def build_stream(out: str, kind: str, rows: int, tag: int, seq_len: int,
                 size_limit: int = SHARD) -> None:
    """``rows`` synthetic rows (the test helpers' rows) in shards of ``size_limit`` bytes."""
    mix_helpers.build_stream(out, kind, rows, tag, seq_len, size_limit=size_limit)


def read_epoch(cfg: dict, batch: int, seq_len: int) -> tuple[float, int]:
    """Seconds from building the loader to the last batch, and the tokens it held."""
    start = time.perf_counter()
    mixer = StreamMixer.from_dict(cfg)
    for attempt in range(3):
        try:
            loader = mixer.build_dataloader(batch_size=batch)
            break
        except FileExistsError as e:  # streaming's machine-global shm names: another job raced us
            if attempt == 2:
                raise
            print(f'  (retrying the loader: {e})')
    rows = sum(b['input_ids'].shape[0] for b in loader)
    secs = time.perf_counter() - start
    del loader, mixer
    gc.collect()
    return secs, rows * seq_len


def main() -> int:
    warnings.filterwarnings('ignore', message='The given NumPy array is not writable')
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rows', type=int, default=40000, help='rows of the pretrain stream (finetune: 1/4)')
    ap.add_argument('--seq-len', type=int, default=2048)
    ap.add_argument('--batch-size', type=int, default=8)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--error-rate', type=float, default=0.05)
    ap.add_argument('--shard-mb', type=int, default=SHARD >> 20,
                    help='shard size_limit in MB (default: the converter\'s 64); smaller shards '
                         'mean more requests, so a 5%% fault rate meets a few of them')
    ap.add_argument('--quick', action='store_true', help='4000 rows, 1 repeat: a smoke run')
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats = 4000, 1

    counter = s3_retries.install()
    root = tempfile.mkdtemp(prefix='fmx-bench-s3-')
    try:
        t0 = time.perf_counter()
        dirs = {'web': os.path.join(root, 'src', 'web'), 'chat': os.path.join(root, 'src', 'chat')}
        build_stream(dirs['web'], 'pretrain', args.rows, 0, args.seq_len, args.shard_mb << 20)
        build_stream(dirs['chat'], 'finetune', args.rows // 4, 1, args.seq_len, args.shard_mb << 20)
        files = [(n, f) for n, d in dirs.items() for f in sorted(os.listdir(d))]
        size = sum(os.path.getsize(os.path.join(dirs[n], f)) for n, f in files)
        shards = sum(f.endswith('.mds') for _, f in files)
        print(f'corpus: {shards} shards (size_limit {args.shard_mb} MB), {size / 2**20:.0f} MiB, '
              f'{args.rows + args.rows // 4} rows x {args.seq_len} tokens, built in '
              f'{time.perf_counter() - t0:.1f}s')

        with moto_s3(BUCKET) as s3:
            t0 = time.perf_counter()
            for name, f in files:
                s3['client'].upload_file(os.path.join(dirs[name], f), BUCKET, f'{name}/{f}')
            print(f'uploaded to moto on {s3["endpoint"]} in {time.perf_counter() - t0:.1f}s; '
                  f'batch {args.batch_size}, {args.workers} DataLoader workers, {args.repeats} repeats')

            def cfg(cache: str) -> dict:
                return {'streams': {'web': {'remote': f's3://{BUCKET}/web'},
                                    'chat': {'remote': f's3://{BUCKET}/chat', 'repeat': 1}},
                        'shuffle': True, 'shuffle_seed': 1, 'num_workers': args.workers,
                        'cache_root': cache}

            rates: dict[str, list[float]] = {'cold': [], 'warm': [], 'faults': []}
            for r in range(args.repeats):
                cache = os.path.join(root, f'cache-{r}')
                for mode in ('cold', 'warm', 'faults'):
                    before = counter.snapshot()
                    if mode == 'faults':
                        cache = os.path.join(root, f'cache-{r}-faults')
                        with FaultProxy(s3['endpoint'], error_rate=args.error_rate, seed=r) as proxy:
                            os.environ['S3_ENDPOINT_URL'] = proxy.endpoint
                            try:
                                secs, tokens = read_epoch(cfg(cache), args.batch_size, args.seq_len)
                            finally:
                                os.environ['S3_ENDPOINT_URL'] = s3['endpoint']
                        injected = f", proxy injected {proxy.counts['503']} x 503"
                    else:
                        secs, tokens = read_epoch(cfg(cache), args.batch_size, args.seq_len)
                        injected = ''
                    rates[mode].append(tokens / secs)
                    print(f'repeat {r} {mode:6s}: {tokens / secs / 1e6:7.2f} M tokens/s ({secs:.2f}s; '
                          f'{(counter.snapshot() - before).line()}{injected})')
                for c in (cache, os.path.join(root, f'cache-{r}')):
                    shutil.rmtree(c, ignore_errors=True)

        warm = statistics.median(rates['warm'])
        for mode, values in rates.items():
            med = statistics.median(values)
            print(f'{mode:6s}: {med / 1e6:7.2f} M tokens/s median [{min(values) / 1e6:.2f} .. '
                  f'{max(values) / 1e6:.2f}], {med / warm:.3f} x warm')
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
