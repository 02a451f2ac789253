"""Shard downloads per shard per pass under a tight ``cache_limit``, this tree against another
(``--before``: a checkout of an earlier foundrymix), read in alternating fresh processes (A B A ...).

The case of issue 55: one remote stream of 14 shards (~1.3 MB, ~93 KB each) on moto's S3 server
on loopback, ``cache_limit: 500kb`` (5 shards) and the default shuffle, one epoch of batch 8
with no DataLoader worker. Every GET of a shard is counted on the wire by a relaying proxy
(tests/fault_proxy.py, no faults); the peak of all files under the cache root is sampled after
every batch. Prints each read, then the median downloads per shard per pass and seconds of
each tree and the ratios before / after.

    .venv/bin/python benchmarks/bench_cache.py --before /tmp/foundrymix-old [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, 'tests'))

from fault_proxy import FaultProxy  # noqa: E402
from helpers import moto_s3  # noqa: E402
from mix_helpers import build_stream  # noqa: E402

BUCKET = 'fmx-bench-cache'
READ = """
import json, os, sys, time
from foundrymix.loader.mixer import StreamMixer
cfg, root = json.loads(sys.argv[1]), sys.argv[2]
start = time.monotonic()
ld = StreamMixer.from_dict(cfg).build_dataloader(batch_size=8)
peak = batches = 0
for _ in ld:
    batches += 1
    peak = max(peak, sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(root) for f in fs
                         if os.path.exists(os.path.join(b, f))))
print(json.dumps({'seconds': time.monotonic() - start, 'peak': peak, 'batches': batches}))
"""


def read(tree: str, remote: str, limit: str, proxy: FaultProxy, env: dict) -> dict:
    root = tempfile.mkdtemp(prefix='bench-cache-')
    cfg = {'streams': {'a': {'remote': remote}}, 'cache_limit': limit, 'cache_root': root, 'shuffle_seed': 3}
    del proxy.log[:]
    out = subprocess.run([sys.executable, '-c', READ, json.dumps(cfg), root], capture_output=True, text=True, cwd=root,
                         env={**os.environ, **env, 'S3_ENDPOINT_URL': proxy.endpoint, 'PYTHONPATH': tree})
    if out.returncode:
        return {'error': (out.stderr.strip().splitlines() or ['?'])[-1]}
    got = json.loads(out.stdout.strip().splitlines()[-1])
    gets = Counter(p for m, p, _ in proxy.log if m == 'GET' and '/shard.' in p)
    got.update(downloads=sum(gets.values()), shards=len(gets))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--before', required=True, help='a checkout of the foundrymix to compare with')
    ap.add_argument('--rounds', type=int, default=1)
    ap.add_argument('--limit', default='500kb')
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, moto_s3(BUCKET) as s3, FaultProxy(s3['endpoint']) as proxy:
        d = os.path.join(tmp, 'a')
        build_stream(d, 'pretrain', 14 * 23, 0, max_seq_len=2048, size_limit=96 << 10)
        shards = sorted(f for f in os.listdir(d) if f.startswith('shard.'))
        for f in sorted(os.listdir(d)):
            s3['client'].upload_file(os.path.join(d, f), BUCKET, f'a/{f}')
        size = sum(os.path.getsize(os.path.join(d, f)) for f in shards)
        print(f'{len(shards)} shards, {size:,} bytes; cache_limit {args.limit}')
        trees = {'before': os.path.abspath(args.before), 'after': ROOT}
        runs: dict[str, list[dict]] = {'before': [], 'after': []}
        for r in range(args.rounds):
            for name in (['before', 'after', 'before'] if r == 0 else ['after', 'before']):
                got = read(trees[name], f's3://{BUCKET}/a', args.limit, proxy, s3['env'])
                print(name, got, flush=True)
                if 'error' not in got:
                    runs[name].append(got)
        med = {n: {k: statistics.median(g[k] for g in runs[n]) for k in ('downloads', 'seconds', 'peak')}
               for n in runs if runs[n]}
        for n, m in med.items():
            print(f'{n}: {m["downloads"] / len(shards):.2f} downloads per shard per pass '
                  f'({m["downloads"]:.0f}), {m["seconds"]:.1f} s, peak {m["peak"]:,.0f} bytes on the cache disk')
        if len(med) == 2:
            print(f'after / before: downloads {med["after"]["downloads"] / med["before"]["downloads"]:.4f}, '
                  f'seconds {med["after"]["seconds"] / med["before"]["seconds"]:.3f}')


if __name__ == '__main__':
    main()
