"""Benchmark ``foundrymix adopt`` of LLM-Foundry token shards against ``cat`` of the same shards.

Builds Foundry-style pretrain shards (``{'tokens': 'ndarray:int32'}``, rows of
``--max-seq-len`` ids from the bundled tokenizer's vocabulary, an EOS every ~1,500 tokens,
streaming's ``MDSWriter``; default 200 MB of shards, ``--compression none`` or ``zstd``),
then measures in the same run, ``--rounds`` times, alternating:

(a) ``cat`` of every shard file to ``/dev/null`` (the files are in the page cache after
    the first round; a subprocess, as a user would time it);
(b) the whole ``foundrymix adopt`` as a subprocess (start-up, reading, decompressing,
    re-cutting and writing the foundrymix shards and manifest);
(c) ``adopt()`` in this process once the modules and the tokenizer are loaded (a warm-up
    run first): the steady-state rate without the start-up (importing transformers
    to load the tokenizer is most of it);
(d) for zstd shards, also reading and decompressing them with ``zstandard`` (the codec
    streaming uses), the decompression ceiling: ``cat`` alone reads only compressed bytes.

All are given as MB/s of the *source* shard bytes; the ratios (b)/(a) and (c)/(a) are
the share of disk/decompression speed adopt reaches (target >= 0.5). Medians and ranges
are printed, with the 1-minute load average before and after: other work on the machine
skews all of them.

    .venv/bin/python benchmarks/bench_adopt.py [--mb 200] [--rounds 3] [--compression none|zstd]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
#: the bundled tokenizer, whose ids (and EOS 0) the shards are made of
TOKENIZER = 'foundrymix-bpe-8k'


def build_shards(out: Path, megabytes: int, seq: int, compression: str | None, seed: int = 0) -> int:
    """Foundry token shards of about ``megabytes`` MB of ids; returns the number of rows."""
    from streaming import MDSWriter
    rng = np.random.default_rng(seed)
    n_rows = megabytes * (1 << 20) // (4 * seq)
    with MDSWriter(out=str(out), columns={'tokens': 'ndarray:int32'}, compression=compression) as w:
        for _ in range(n_rows):
            row = rng.integers(2, 8192, size=seq, dtype=np.int32)
            row[rng.random(seq) < 1 / 1500] = 0  # the bundled tokenizer's EOS
            w.write({'tokens': row})
    return n_rows


def shard_files(src: Path) -> list[str]:
    return sorted(str(p) for p in src.iterdir() if p.name.startswith('shard.'))


def time_cat(files: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(['cat', *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def time_adopt(src: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''),
               HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    t = time.perf_counter()
    subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'adopt', str(src), '--out', str(out),
                    '--tokenizer', TOKENIZER, '--no-progress'], check=True, env=env)
    return time.perf_counter() - t


def time_decompress(files: list[str]) -> float:
    import zstandard
    t = time.perf_counter()
    for f in files:
        with open(f, 'rb') as fh:
            zstandard.decompress(fh.read())
    return time.perf_counter() - t


def time_in_process(src: Path, out: Path) -> float:
    from foundrymix.convert.adopt import AdoptArgs, adopt
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    adopt(AdoptArgs(source=str(src), out=str(out), tokenizer=TOKENIZER))
    return time.perf_counter() - t


def _median_range(values: list[float]) -> str:
    return f'{statistics.median(values):,.0f} MB/s (range {min(values):,.0f}-{max(values):,.0f})'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mb', type=int, default=200, help='source shard MB (default 200)')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--max-seq-len', type=int, default=2048)
    ap.add_argument('--compression', default='none', help='none (default) or zstd')
    args = ap.parse_args()
    compression = None if args.compression == 'none' else args.compression
    tmp = Path(tempfile.mkdtemp(prefix='bench-adopt-'))
    try:
        src = tmp / 'foundry'
        rows = build_shards(src, args.mb, args.max_seq_len, compression)
        files = shard_files(src)
        size = sum(os.path.getsize(f) for f in files) / (1 << 20)
        print(f'{rows:,} rows of {args.max_seq_len} in {len(files)} shard(s), {size:,.0f} MB '
              f'({args.compression}); load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores')
        cat, adopt, warm, ratio, warm_ratio = [], [], [], [], []
        time_cat(files)  # warm the page cache for all
        time_in_process(src, tmp / 'out')  # imports and the tokenizer, once
        for _ in range(args.rounds):
            c = time_cat(files)
            a = time_adopt(src, tmp / 'out')
            w = time_in_process(src, tmp / 'out')
            cat.append(size / c)
            adopt.append(size / a)
            warm.append(size / w)
            ratio.append(c / a)
            warm_ratio.append(c / w)
        print(f'cat:                       {_median_range(cat)}')
        print(f'adopt (CLI, with start-up): {_median_range(adopt)}')
        print(f'adopt (in-process, warm):  {_median_range(warm)}')
        for name, r in (('CLI', ratio), ('warm', warm_ratio)):
            print(f'adopt/cat ({name}): median {statistics.median(r):.3f} (range {min(r):.3f}-{max(r):.3f}); '
                  f'target >= 0.5')
        if compression:
            dz = [size / time_decompress(files) for _ in range(args.rounds)]
            print(f'read + zstd decompress:    {_median_range(dz)}; adopt (warm) / that: '
                  f'{statistics.median(warm) / statistics.median(dz):.3f}')
        print(f'load after {os.getloadavg()[0]:.1f}')
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__':
    main()
