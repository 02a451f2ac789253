"""Benchmark an adaptive weight update (segment switch) against a plain batch.

An update is what happens at a segment boundary: the policy's update from the summed
per-stream loss and the next segment's sample ids from the per-stream cursors
(:meth:`AdaptiveController.update` + :meth:`~AdaptiveController.segment_ids`); no dataset
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
    from foundrymix.plan.adaptive import AdaptiveController
    return AdaptiveController(method=method, names=[f's{i}' for i in range(streams)],
                              rows=[rows] * streams, initial=[1 / streams] * streams,
                              global_batch=G, every=every, warmup=0, min_share=0.5 / streams,
                              seed=7, start_batch=0, batches=every * 1000)


def time_update(c, k: int, rng) -> float:
    loss = rng.uniform(2, 4, len(c.rows)) * 1000
    t = time.perf_counter()
    c.update(loss, np.full(len(c.rows), 1000.0))
    c.segment_ids(k)
    return time.perf_counter() - t


def plain_batch(G: int, seq: int, rounds: int) -> list[float]:
    from mix_helpers import build_stream

    from foundrymix.loader.collate import collate
    from foundrymix.loader.run_loader import build_run_loader
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
    loader = build_run_loader(run, G)
    it = iter(loader)
    next(it)  # the dataset is built; shards opened
    dataset = loader._active.dataset
    c = loader.position.adaptive[0]
    ids = c.segment_ids(0).reshape(-1, G)
    out = []
    for r in range(rounds):
        t = time.perf_counter()
        collate([dataset.get_row(int(i)) for i in ids[1 + r % (len(ids) - 1)]])
        out.append(time.perf_counter() - t)
    loader.release()
    return out


def fmt(xs: list[float]) -> str:
    return f'{1000 * statistics.median(xs):.2f} ms (range {1000 * min(xs):.2f}-{1000 * max(xs):.2f})'


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument('--rows', type=int, default=10_000)
    ap.add_argument('--global-batch', type=int, default=512)
    ap.add_argument('--every', type=int, default=50)
    ap.add_argument('--seq', type=int, default=2048)
    ap.add_argument('--rounds', type=int, default=5)
    a = ap.parse_args()
    print(f'load before: {os.getloadavg()[0]:.2f}')
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
