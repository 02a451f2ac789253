"""Benchmark ``foundrymix convert`` against each tokenizer's own batch throughput.

For each tokenizer (the bundled BPE and Mistral's SentencePiece model from
``mistral-common``) and each kind (pretrain: the arXiv sample; finetune: the Dolly/HH
sample as prompt/response, packed), builds a jsonl corpus (default 150 MB, ``--quick``
20 MB) by repeating the sample in shuffled order, then measures in the same run,
``--rounds`` times (medians and ranges are printed):

(a) the ceiling: the Rust tokenizer's ``encode_batch_fast`` (or ``encode_batch``) on the
    same texts (pretrain: each document; finetune: each prompt and each response, as the
    converter encodes them) with its own thread pool on all cores
    (``TOKENIZERS_PARALLELISM=true``), in batches of 64 records (``--batch-docs``), timing
    the encode calls only (not reading, JSON parsing or start-up);
(b) the whole ``foundrymix convert`` as a subprocess (start-up, reading, parsing,
    assembling, packing, writing shards included), with the peak RSS of its process tree.

Each round brackets (b) between (a) on the first and (a) on the second half of the
corpus, so a load that changes during the round weighs on both alike. Both are given
as tokens/s of the *same* token count (the ceiling's: the texts'
tokens, without BOS/EOS), so the ratio is the share of the ceiling the whole conversion
reaches (targets: pretrain >= 0.85, finetune >= 0.7). The 1-minute load average is
printed before and after: other work on the machine skews the ratio.

    .venv/bin/python benchmarks/bench_convert.py [--quick] [--mb N] [--rounds 3]
        [--tokenizers bpe,spm] [--kinds pretrain,finetune] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = {'pretrain': ROOT / 'data' / 'samples' / 'arxiv_sample.jsonl',
           'finetune': ROOT / 'data' / 'samples' / 'dolly_hhrlhf_sample.jsonl'}
#: the texts of a record that the converter tokenizes, per kind
FIELDS = {'pretrain': ('text',), 'finetune': ('prompt', 'response')}
TARGETS = {'pretrain': 0.85, 'finetune': 0.7}


def tokenizer_path(name: str) -> str:
    """``bpe``: the bundled tokenizer; ``spm``: Mistral's SentencePiece model (tests/helpers.py)."""
    if name == 'bpe':
        return 'foundrymix-bpe-8k'
    sys.path.insert(0, str(ROOT / 'tests'))
    from helpers import spm_tokenizer_path
    return spm_tokenizer_path()


def build_corpus(path: Path, kind: str, megabytes: int, seed: int = 0) -> int:
    """Write shuffled repeats of the kind's sample until ``megabytes``; return the record count."""
    lines = SAMPLES[kind].read_bytes().splitlines(keepends=True)
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


def ceiling(path: Path, tokenizer: str, kind: str, batch_docs: int = 64,
            half: int | None = None) -> tuple[float, int]:
    """Tokens/s of the tokenizer's own parallel batch encoder (tokenization time only):
    ``(tokens / seconds, tokens)``; ``half`` (0 or 1): only that half of the records."""
    os.environ['TOKENIZERS_PARALLELISM'] = 'true'
    from foundrymix.tokenizer import load_tokenizer
    backend = load_tokenizer(tokenizer).backend_tokenizer
    encode = getattr(backend, 'encode_batch_fast', backend.encode_batch)
    with open(path, encoding='utf-8') as f:
        lines = f.readlines()
    if half is not None:
        lines = lines[:len(lines) // 2] if half == 0 else lines[len(lines) // 2:]
    tokens, seconds = 0, 0.0
    for start in range(0, len(lines), batch_docs):
        texts = [rec[k] for line in lines[start:start + batch_docs]
                 for rec in [json.loads(line)] for k in FIELDS[kind]]
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


def run_convert(corpus: Path, out: Path, kind: str, tokenizer: str, max_seq_len: int, workers: int,
                parallel: str | None) -> dict:
    """Time one whole conversion as a subprocess; peak memory of its process tree."""
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', kind, str(corpus), '-o', str(out),
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
    manifest = json.loads((out / 'foundrymix.json').read_text())
    return {'seconds': seconds, 'peak_rss': peak, 'peak_pss': peak_pss, 'counts': manifest['counts'],
            'dropped': manifest.get('dropped', {})}


def measure(tmp: Path, kind: str, tok_name: str, args: argparse.Namespace) -> dict:
    """One round: the ceiling on the first half of the corpus, the conversion of the whole
    corpus, the ceiling on the second half. Bracketing the conversion this way, at no
    extra cost, gives a load that rises or falls during the round about the same weight
    in both figures."""
    corpus = tmp / f'{kind}.jsonl'
    out = tmp / f'out-{kind}-{tok_name}'
    tok = tokenizer_path(tok_name)
    load = [os.getloadavg()[0]]
    rate0, tokens0 = ceiling(corpus, tok, kind, args.batch_docs, half=0)
    load.append(os.getloadavg()[0])
    conv = run_convert(corpus, out, kind, tok, args.max_seq_len, args.workers, args.parallel)
    load.append(os.getloadavg()[0])
    rate1, tokens1 = ceiling(corpus, tok, kind, args.batch_docs, half=1)
    load.append(os.getloadavg()[0])
    shutil.rmtree(out)
    tokens = tokens0 + tokens1
    ceil_tok_s = tokens / (tokens0 / rate0 + tokens1 / rate1)
    conv_tok_s = tokens / conv['seconds']
    return {'conv': conv_tok_s, 'ceil': ceil_tok_s, 'ratio': conv_tok_s / ceil_tok_s, 'tokens': tokens,
            'seconds': conv['seconds'], 'rss': conv['peak_rss'], 'pss': conv['peak_pss'], 'load': load,
            'dropped': conv['dropped']}


def _median_range(values: list[float], fmt: str) -> str:
    return f'{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]'


def report(kind: str, tok_name: str, rounds: list[dict]) -> None:
    """Medians [ranges] over the rounds of one tokenizer and kind."""
    r0 = rounds[0]
    print(f'{kind:8s} {tok_name:3s}: convert {_median_range([r["conv"] for r in rounds], ",.0f")} tok/s, '
          f'ceiling {_median_range([r["ceil"] for r in rounds], ",.0f")} tok/s, ratio '
          f'{_median_range([r["ratio"] for r in rounds], ".2f")} (target >= {TARGETS[kind]}); '
          f'{r0["tokens"]:,} tokens, peak RSS {max(r["rss"] for r in rounds) / 2**20:,.0f} MB, '
          f'PSS {max(r["pss"] for r in rounds) / 2**20:,.0f} MB; load '
          + ', '.join('/'.join(f'{x:.1f}' for x in r['load']) for r in rounds)
          + (f'; dropped {r0["dropped"]}' if r0['dropped'] else ''), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mb', type=int, default=150, help='corpus size in MB (default 150)')
    ap.add_argument('--quick', action='store_true', help='20 MB corpora')
    ap.add_argument('--rounds', type=int, default=3, help='measurements per case (default 3)')
    ap.add_argument('--tokenizers', default='bpe,spm', help='bpe (bundled), spm (Mistral SentencePiece)')
    ap.add_argument('--kinds', default='pretrain,finetune')
    ap.add_argument('--max-seq-len', type=int, default=2048)
    ap.add_argument('--workers', type=int, default=0, help='convert --workers (0 = all cores)')
    ap.add_argument('--parallel', choices=('threads', 'processes'), default=None,
                    help='convert --parallel (default: the converter\'s default)')
    ap.add_argument('--batch-docs', type=int, default=64, help='records per encode call of the ceiling')
    args = ap.parse_args()
    mb = 20 if args.quick else args.mb
    kinds, toks = args.kinds.split(','), args.tokenizers.split(',')
    with tempfile.TemporaryDirectory(prefix='fm-bench-') as tmp:
        for kind in kinds:
            n = build_corpus(Path(tmp) / f'{kind}.jsonl', kind, mb)
            print(f'{kind} corpus: {mb} MB, {n:,} records', flush=True)
        print(f'{os.cpu_count()} cores; rounds {args.rounds}; figures: median [min-max], the ratio taken '
              f'per round; load: 1-min load average before the round, before and after the '
              f'conversion, after the round', flush=True)
        results = {(k, t): [] for k in kinds for t in toks}
        for _ in range(args.rounds):  # rounds interleaved, so a burst of load hits every case
            for key in results:
                results[key].append(measure(Path(tmp), *key, args))
        for (kind, tok_name), rounds in results.items():
            report(kind, tok_name, rounds)


if __name__ == '__main__':
    main()
