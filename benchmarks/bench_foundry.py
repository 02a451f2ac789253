"""LLM-Foundry token shards read in place against the same data adopted (converted) first.

One synthetic Foundry dataset (rows of ``--seq-len`` int32 tokens, an EOS every few hundred
tokens, written with streaming's ``MDSWriter`` as LLM-Foundry's converters write it) is read
two ways in the same run, alternating in-place / adopted / in-place / ... (A-B-A, so machine
noise hits both alike): as a stream with ``tokenizer:`` (each row cut into documents as it is
read) and as the ``foundrymix adopt`` output of the same directory. Both through
``StreamMixer.build_dataloader`` with the same batch, workers and shuffle; the first batch of
each epoch (worker start-up) is not timed.

    .venv/bin/python benchmarks/bench_foundry.py [--rows 3000] [--seq-len 2048] [--rounds 3]

Prints tokens/s of each side per round and the ratio in-place / adopted (target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_loader import one_epoch  # noqa: E402

TOKENIZER = 'foundrymix-bpe-8k'


def write_foundry(out: str, rows: int, seq_len: int, eos: int) -> None:
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    with MDSWriter(out=out, columns={'tokens': 'ndarray:int32'}, size_limit=1 << 26) as w:
        for _ in range(rows):
            row = rng.integers(2, 8000, seq_len, dtype=np.int32)
            row[rng.integers(0, seq_len, max(1, seq_len // 400))] = eos
            w.write({'tokens': row})


def main() -> int:
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.tokenizer import describe_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--rows', type=int, default=3000)
    ap.add_argument('--seq-len', type=int, default=2048)
    ap.add_argument('--batch-size', type=int, default=8)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--rounds', type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix='bench-foundry-') as work:
        src, adopted = os.path.join(work, 'foundry'), os.path.join(work, 'adopted')
        write_foundry(src, args.rows, args.seq_len, describe_tokenizer(TOKENIZER).eos_id)
        subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'adopt', src, '--out', adopted,
                        '--tokenizer', TOKENIZER], check=True, stdout=subprocess.DEVNULL)
        loader = {'shuffle': True, 'num_workers': args.workers, 'cache_root': os.path.join(work, 'cache')}
        sides = {'in place': {'streams': {'c4': {'local': src, 'tokenizer': TOKENIZER}}, **loader},
                 'adopted': {'streams': {'c4': {'local': adopted}}, **loader}}
        rates: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in (('in place', 'adopted') if r % 2 == 0 else ('adopted', 'in place')):
                dl = StreamMixer.from_dict(sides[name]).build_dataloader(args.batch_size)
                seconds, tokens, _ = one_epoch(dl, args.seq_len)
                dl.release()
                rates[name].append(tokens / seconds)
                print(f'round {r + 1} {name:>8}: {tokens / seconds / 1e6:6.2f}M tokens/s', flush=True)
        ratios = [a / b for a, b in zip(rates['in place'], rates['adopted'])]
        print(f'in place / adopted: median {statistics.median(ratios):.3f} '
              f'(per round {", ".join(f"{x:.3f}" for x in ratios)}; target >= 0.9)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
