"""Benchmark ``foundrymix convert pretrain`` against the tokenizer's own batch throughput.

Builds a jsonl corpus (default 150 MB, ``--quick`` 20 MB) by repeating the bundled arXiv
sample in shuffled order, then measures in the same run:

(a) the ceiling: the Rust tokenizer's ``encode_batch_fast`` (or ``encode_batch``) on the
    same documents with its own thread pool on all cores (``TOKENIZERS_PARALLELISM=true``),
    in batches of 64 documents (``--batch-docs``), timing the encode calls only (not
    reading, JSON parsing or start-up);
(b) the whole ``foundrymix convert pretrain`` as a subprocess (start-up, reading,
    parsing, writing shards included), with the peak RSS of its process tree.

Prints tokens/s for both and their ratio (target >= 0.75), and the 1-minute load
average before and after each measurement: other work on the machine skews the ratio,
so measure when the load is low.

    .venv/bin/python benchmarks/bench_convert.py [--quick] [--mb N] [--workers N] [--parallel MODE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / 'data' / 'samples' / 'arxiv_sample.jsonl'


def build_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """Write shuffled repeats of the sample until ``megabytes``; return the document count."""
    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    rng = random.Random(seed)
    target, size, n = megabytes << 20, 0, 0
    with open(path, 'wb') as f:
        while size < target:
            rng.shuffle(lines)
            for line in lines:
                f.write(line)
                size += len(line)
                n += 1
    return n


def ceiling(path: Path, tokenizer: str, batch_docs: int = 64) -> tuple[float, int]:
    """Tokens/s of the tokenizer's own parallel batch encoder (tokenization time only)."""
    os.environ['TOKENIZERS_PARALLELISM'] = 'true'
    from foundrymix.tokenizer import load_tokenizer
    backend = load_tokenizer(tokenizer).backend_tokenizer
    encode = getattr(backend, 'encode_batch_fast', backend.encode_batch)
    tokens, seconds = 0, 0.0
    with open(path, encoding='utf-8') as f:
        while True:
            texts = [json.loads(line)['text'] for _, line in zip(range(batch_docs), f)]
            if not texts:
                break
            t0 = time.perf_counter()
            enc = encode(texts, add_special_tokens=False)
            seconds += time.perf_counter() - t0
            tokens += sum(len(e.ids) for e in enc)
    return tokens / seconds, tokens


def tree_memory(proc: psutil.Process, pss: bool) -> tuple[int, int]:
    """(RSS, PSS) summed over the process tree; RSS counts pages shared by forked workers
    once per process, PSS splits them, so PSS is the tree's real footprint. PSS (0 unless
    ``pss``) walks the page tables: ~15 ms of CPU for a process that imported torch."""
    rss_sum = pss_sum = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            if pss:
                info = p.memory_full_info()
                rss_sum += info.rss
                pss_sum += getattr(info, 'pss', info.rss)
            else:
                rss_sum += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return rss_sum, pss_sum


def run_convert(corpus: Path, out: Path, tokenizer: str, max_seq_len: int, workers: int,
                parallel: str | None) -> dict:
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(corpus), '-o', str(out),
           '--tokenizer', tokenizer, '--max-seq-len', str(max_seq_len), '--workers', str(workers),
           '--no-progress', *(['--parallel', parallel] if parallel else [])]
    t0 = time.perf_counter()
    proc = psutil.Popen(cmd)
    peak = peak_pss = 0
    last_pss = 0.0
    while proc.poll() is None:
        # RSS is cheap: every 0.1 s. PSS costs CPU the conversion would miss: every 2 s.
        now = time.perf_counter()
        rss, pss = tree_memory(proc, pss=now - last_pss >= 2.0)
        if pss:
            last_pss = now
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f'conversion failed with exit code {proc.returncode}')
    counts = json.loads((out / 'foundrymix.json').read_text())['counts']
    tokens = counts['tokens'] + counts['tail_tokens']
    return {'seconds': seconds, 'tokens': tokens, 'tok_s': tokens / seconds, 'peak_rss': peak,
            'peak_pss': peak_pss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mb', type=int, default=150, help='corpus size in MB (default 150)')
    ap.add_argument('--quick', action='store_true', help='20 MB corpus')
    ap.add_argument('--tokenizer', default='foundrymix-bpe-8k')
    ap.add_argument('--max-seq-len', type=int, default=2048)
    ap.add_argument('--workers', type=int, default=0, help='convert --workers (0 = all cores)')
    ap.add_argument('--parallel', choices=('threads', 'processes'), default=None,
                    help='convert --parallel (default: the converter\'s default)')
    ap.add_argument('--batch-docs', type=int, default=64, help='documents per encode call of the ceiling')
    args = ap.parse_args()
    mb = 20 if args.quick else args.mb
    with tempfile.TemporaryDirectory(prefix='fm-bench-') as tmp:
        corpus = Path(tmp) / 'corpus.jsonl'
        docs = build_corpus(corpus, mb)
        print(f'corpus: {corpus.stat().st_size / 2**20:.0f} MB, {docs:,} documents, '
              f'{os.cpu_count()} cores', flush=True)
        load = [os.getloadavg()[0]]
        conv = run_convert(corpus, Path(tmp) / 'out', args.tokenizer, args.max_seq_len, args.workers,
                           args.parallel)
        load.append(os.getloadavg()[0])
        ceil_tok_s, ceil_tokens = ceiling(corpus, args.tokenizer, args.batch_docs)
        load.append(os.getloadavg()[0])
    # the conversion's tokens include one EOS per document
    assert conv['tokens'] == ceil_tokens + docs, (conv['tokens'], ceil_tokens, docs)
    print(f'ceiling (tokenizer batch encode, all cores, {args.batch_docs} docs per call): '
          f'{ceil_tok_s:,.0f} tok/s ({ceil_tokens:,} tokens)')
    print(f'foundrymix convert pretrain (whole process): {conv["tok_s"]:,.0f} tok/s '
          f'({conv["tokens"]:,} tokens in {conv["seconds"]:.1f} s)')
    print(f'ratio: {conv["tok_s"] / ceil_tok_s:.2f}  (target >= 0.75)')
    print(f'peak memory of the conversion process tree: RSS {conv["peak_rss"] / 2**20:,.0f} MB '
          f'(sampled every 0.1 s), PSS {conv["peak_pss"] / 2**20:,.0f} MB (every 2 s)')
    print(f'1-minute load average (the benchmark itself included): {load[0]:.2f} before, '
          f'{load[1]:.2f} after the conversion, '
          f'{load[2]:.2f} after the ceiling')


if __name__ == '__main__':
    main()
