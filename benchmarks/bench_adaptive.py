"""Benchmark an adaptive weight update (segment switch) against a plain batch.

An update is what happens at a segment boundary: the policy's update from the summed
per-stream loss and the next segment's sample ids from the per-stream cursors
(:meth:`AdaptiveController.update` + :meth:`~AdaptiveController.segment_rows`); no dataset
is rebuilt. Measured for 10 and 1,000 streams (``--rows`` rows each), a global batch of
``--global-batch`` rows and segments of ``--every`` batches, ``--rounds`` times:

(a) an update with every stream's current pass permutation already made (steady state);
(b) the first update that touches every stream (each stream's permutation is made then:
    a one-off per pass, ``rows x 4`` bytes of memory per stream);
(c) a plain batch of this machine's loader: ``--global-batch`` synthetic rows of
    ``--seq`` tokens read from 10 real MDS streams by index and collated (one rank doing
    the whole global batch: an upper bound of the loader's share of a step).

Medians and ranges, with the 1-minute load average before and after.

    .venv/bin/python benchmarks/bench_adaptive.py [--rows 10000] [--global-batch 512] [--every 50]

``--proof``: does it do something? The bundled arXiv and Dolly samples (the last 2 papers
and 100 examples held out), a stream of uniformly random tokens (``noise``: nothing to
learn) and a copy of the arXiv stream (``arxiv_dup``), all at 0.25, trained by a tiny Llama
on the CPU (one thread) for ``--batches`` batches of 16 rows per method (``fixed``, ``odm``, ``ado``;
same seeds, same tokens). Prints, per method, where the weights went and the held-out
loss on the useful streams (arXiv + Dolly), and draws the weights per method into
``--png``.

    .venv/bin/python benchmarks/bench_adaptive.py --proof [--batches 300] [--png docs/adaptive_proof.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))


def controller(streams: int, rows: int, G: int, every: int, method: str = 'odm'):
    from foundrymix.plan.adaptive import AdaptiveController, AdaptiveSpec
    from foundrymix.plan.order import stream_draws
    names = tuple(f's{i}' for i in range(streams))
    return AdaptiveController(AdaptiveSpec(
        method=method, names=names, rows=(rows,) * streams, initial=(1 / streams,) * streams,
        global_batch=G, every=every, warmup=0, min_share=0.5 / streams, seed=7, start_batch=0,
        batches=every * 1000, draws=tuple(stream_draws([[rows]] * streams, names, 7, 'main'))))


def time_update(c, k: int, rng) -> float:
    loss = rng.uniform(2, 4, len(c.spec.rows)) * 1000
    t = time.perf_counter()
    c.update(loss, np.full(len(c.spec.rows), 1000.0))
    c.segment_rows(k, np.zeros(len(c.spec.rows), np.int64))
    return time.perf_counter() - t


def plain_batch(G: int, seq: int, rounds: int) -> list[float]:
    from mix_helpers import build_stream

    from foundrymix.loader.collate import collate
    from foundrymix.loader.run_loader import StagedDataLoader
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.stages import plan_run
    root = tempfile.mkdtemp(prefix='bench-adaptive-')
    streams = {}
    for i in range(10):
        d = os.path.join(root, f's{i}')
        build_stream(d, 'pretrain', 2 * G, i, max_seq_len=seq, size_limit=1 << 20)
        streams[f's{i}'] = {'local': d, 'proportion': 0.1}
    cfg = LoaderConfig.from_dict({'streams': streams, 'epoch_size': 10 * G,
                                  'adaptive': {'method': 'fixed', 'every': '1000ba'}})
    run, _ = plan_run(cfg, G, '1000ba')
    loader = StagedDataLoader(run)
    it = iter(loader)
    next(it)  # the dataset is built; shards opened
    dataset = loader.storage
    streams, rows = loader.position.adaptive[0].segment_rows(0, loader.position.order(run.stages[0]).start)
    ids = (dataset.sample_offset_per_stream[streams] + rows).reshape(-1, G)
    out = []
    for r in range(rounds):
        t = time.perf_counter()
        collate([dataset.get_row(int(i)) for i in ids[1 + r % (len(ids) - 1)]])
        out.append(time.perf_counter() - t)
    loader.release()
    return out


def proof_data(work: Path) -> dict[str, str]:
    """The four train streams and the two held-out ones, converted at 128 tokens a row."""
    import json
    import shutil

    from mix_helpers import demo_tokenizer_info

    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
    from foundrymix.convert.writer import ShardWriter
    from foundrymix.format.schema import Counts, Manifest, encode_row
    samples = ROOT / 'data' / 'samples'
    out = {n: str(work / n) for n in ('arxiv', 'dolly', 'noise', 'arxiv_dup', 'arxiv_held', 'dolly_held')}
    if all(os.path.exists(os.path.join(d, 'index.json')) for d in out.values()):
        return out
    papers = (samples / 'arxiv_sample.jsonl').read_text(encoding='utf-8').splitlines()
    dolly = (samples / 'dolly_hhrlhf_sample.jsonl').read_text(encoding='utf-8').splitlines()
    for name, lines in (('arxiv', papers[:-2]), ('arxiv_held', papers[-2:]),
                        ('dolly', dolly[:-100]), ('dolly_held', dolly[-100:])):
        src = work / f'{name}.jsonl'
        src.write_text('\n'.join(lines) + '\n', encoding='utf-8')
        if name.startswith('arxiv'):
            convert_pretrain([str(src)], out[name], PretrainOptions(max_seq_len=128, workers=1))
        else:
            convert_finetune([str(src)], out[name], FinetuneOptions(max_seq_len=128, workers=1))
    shutil.copytree(out['arxiv'], out['arxiv_dup'])
    tok = demo_tokenizer_info()
    rng = np.random.default_rng(0)
    counts = Counts()
    with ShardWriter(out['noise'], 128, 'uint16', size_limit=1 << 20) as w:
        for _ in range(2000):
            w.write(encode_row(rng.integers(0, tok.vocab_size, 128), [(0, 128)], [128], 'uint16'))
            counts.rows += 1
            counts.tokens += 128
            counts.loss_tokens += 128
            counts.documents_read += 1
            counts.documents_written += 1
        w.finish(Manifest(kind='pretrain', max_seq_len=128, token_dtype='uint16', tokenizer=tok,
                          counts=counts, inputs=['uniform random tokens']))
    json.dumps(out)
    return out


METHODS = ('fixed', 'odm', 'ado')


def proof(batches: int, png: str, work: Path) -> None:
    import json

    from helpers import tiny_run_config

    from foundrymix.train.builder import train
    from foundrymix.train.config import TrainConfig
    import torch
    torch.set_num_threads(1)  # a shared machine: one core's worth, the same for every method
    work.mkdir(parents=True, exist_ok=True)
    dirs = proof_data(work)
    train_names = ('arxiv', 'dolly', 'noise', 'arxiv_dup')
    results = {}
    for method in METHODS:
        t = time.perf_counter()
        root = work / f'run-{method}'
        loader = {'streams': {n: {'local': dirs[n], 'proportion': 0.25} for n in train_names},
                  'epoch_size': 1024, 'shuffle_seed': 3, 'num_workers': 0,
                  'adaptive': {'method': method, 'every': '10ba', 'warmup': '20ba', 'min_share': 0.05}}
        held = {'streams': {n: {'local': dirs[n]} for n in ('arxiv_held', 'dolly_held')},
                'shuffle': False, 'num_workers': 0}
        cfg = tiny_run_config(loader, run_name=f'proof-{method}', global_train_batch_size=16,
                              max_duration=f'{batches}ba', eval_loader=held,
                              eval_interval=f'{batches}ba', save_folder=None,
                              device_eval_batch_size=16,  # every held-out row: 265 arXiv + 32 Dolly
                              optimizer={'lr': 0.003},
                              callbacks={'stream_accounting': {'out_dir': str(root / 'report'),
                                                               'plot': False}})
        run = train(TrainConfig.from_dict(cfg))
        metric = run.trainer.state.eval_metrics['eval']['LanguageCrossEntropy'].compute()
        mixture = json.loads((root / 'report' / 'mixture.json').read_text())['stages']['main']
        results[method] = {'held_out_loss': float(metric), 'decisions': mixture['decisions'],
                           'seconds': time.perf_counter() - t}
        last = mixture['decisions'][-1]['weights']
        mean = np.mean([d['weights'] for d in mixture['decisions']], axis=0)
        print(f'{method:>6}: held-out loss (arxiv + dolly) {float(metric):.4f}; last weights '
              + ', '.join(f'{n} {w:.3f}' for n, w in zip(train_names, last)) + '; mean '
              + ', '.join(f'{n} {w:.3f}' for n, w in zip(train_names, mean))
              + f' ({results[method]["seconds"]:.0f} s)', flush=True)
    (work / 'proof.json').write_text(json.dumps(results, indent=1), encoding='utf-8')
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), sharey=True)
    for ax, (method, r) in zip(axes, results.items()):
        xs = [d['batch'] for d in r['decisions']]
        for i, n in enumerate(train_names):
            ax.step(xs, [d['weights'][i] for d in r['decisions']], where='post', label=n)
        ax.set_title(f'{method}: held-out loss {r["held_out_loss"]:.3f}')
        ax.set_xlabel('batch')
    axes[0].set_ylabel('weight')
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    print(f'wrote {png} and {work / "proof.json"}')


def fmt(xs: list[float]) -> str:
    return f'{1000 * statistics.median(xs):.2f} ms (range {1000 * min(xs):.2f}-{1000 * max(xs):.2f})'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument('--rows', type=int, default=10_000)
    ap.add_argument('--global-batch', type=int, default=512)
    ap.add_argument('--every', type=int, default=50)
    ap.add_argument('--seq', type=int, default=2048)
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--proof', action='store_true')
    ap.add_argument('--batches', type=int, default=300)
    ap.add_argument('--png', default=str(ROOT / 'docs' / 'adaptive_proof.png'))
    ap.add_argument('--work', default=os.path.join(tempfile.gettempdir(), 'bench-adaptive-proof'))
    a = ap.parse_args()
    print(f'load before: {os.getloadavg()[0]:.2f}')
    if a.proof:
        proof(a.batches, a.png, Path(a.work))
        print(f'load after: {os.getloadavg()[0]:.2f}')
        return
    rng = np.random.default_rng(0)
    for streams in (10, 1000):
        c = controller(streams, a.rows, a.global_batch, a.every)
        first = [time_update(c, 1, rng)]
        steady = [time_update(c, k, rng) for k in range(2, 2 + a.rounds)]
        print(f'{streams:>5} streams x {a.rows:,} rows, segment {a.every} x {a.global_batch}: '
              f'update {fmt(steady)}; first touch of every stream {fmt(first)}')
    batch = plain_batch(a.global_batch, a.seq, a.rounds)
    print(f'plain batch: {a.global_batch} rows of {a.seq} read + collated: {fmt(batch)}')
    print(f'load after: {os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
    main()
