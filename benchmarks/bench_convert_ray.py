"""Benchmark ``convert pretrain --engine ray`` next to the default engine, in one run.

Builds the same shuffled-arXiv jsonl corpus as ``bench_convert.py`` (default 20 MB) and
measures, as whole ``foundrymix convert pretrain`` subprocesses (start-up included):

(a) the default engine (threads on ``--workers`` cores);
(b) ``--engine ray`` starting its own local Ray with ``--workers`` CPUs, tasks of
    ``--task-mb`` MB (Ray start-up, worker start-up and merge included).

Then the fixed costs, in-process against a local Ray: worker start-up and the cost of
one task (see :func:`task_overhead`). Other work on the machine skews every figure, so
the load average is printed.

    .venv/bin/python benchmarks/bench_convert_ray.py [--mb 20] [--workers 2] [--task-mb 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import build_corpus  # noqa: E402


def run_cli(corpus: Path, out: Path, args: argparse.Namespace, *extra: str) -> dict:
    """One conversion as a subprocess: seconds, tokens (written + tail) and tokens/s."""
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(corpus), '-o', str(out),
           '--max-seq-len', str(args.max_seq_len), '--workers', str(args.workers), '--no-progress', *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    counts = json.loads((out / 'foundrymix.json').read_text())['counts']
    tokens = counts['tokens'] + counts['tail_tokens']
    return {'seconds': seconds, 'tokens': tokens, 'tok_s': tokens / seconds, 'rows': counts['rows']}


def task_overhead(tmp: Path, args: argparse.Namespace, n: int = 64) -> tuple[float, float, float]:
    """What a task costs besides its tokenizing, against a freshly started local Ray.

    ``n`` one-line documents (tokenizing negligible) as ``n`` tasks on a fresh Ray: that
    starts the worker processes (each imports streaming/torch and loads the tokenizer
    once). Then, with warm workers, as one task and again as ``n`` tasks: the extra
    seconds times the CPUs over the extra tasks are what one task costs (scheduling,
    arguments and result, one MDS writer and its index). Returns (cold s, warm s for
    ``n`` tasks, core-s per task).
    """
    import ray

    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
    tiny = tmp / 'tiny.jsonl'
    tiny.write_text(''.join(json.dumps({'text': f'document {i} ' * 40}) + '\n' for i in range(n)))
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    try:
        times = []
        for i, task_bytes in enumerate((1, 1 << 30, 1)):
            t0 = time.perf_counter()
            convert_pretrain([str(tiny)], str(tmp / f'tiny{i}'), PretrainOptions(
                max_seq_len=64, engine='ray', chunk_bytes=1, ray_task_bytes=task_bytes))
            times.append(time.perf_counter() - t0)
    finally:
        ray.shutdown()
    return times[0], times[2], max(0.0, times[2] - times[1]) * args.workers / (n - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mb', type=int, default=20, help='corpus size in MB (default 20)')
    ap.add_argument('--workers', type=int, default=2, help='cores (default engine) = Ray CPUs')
    ap.add_argument('--task-mb', type=float, default=4.0, help='input MB per Ray task (default 4)')
    ap.add_argument('--max-seq-len', type=int, default=2048)
    args = ap.parse_args()
    os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix='fm-bench-ray-') as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / 'corpus.jsonl'
        docs = build_corpus(corpus, args.mb)
        print(f'corpus: {corpus.stat().st_size / 2**20:.1f} MB, {docs:,} documents; '
              f'{args.workers} cores / Ray CPUs', flush=True)
        local = run_cli(corpus, tmp / 'local', args)
        print(f"default engine:          {local['tok_s']:>10,.0f} tok/s ({local['tokens']:,} tokens in "
              f"{local['seconds']:.1f} s, {local['rows']:,} rows)", flush=True)
        rayed = run_cli(corpus, tmp / 'ray', args, '--engine', 'ray', '--ray-task-mb', str(args.task_mb))
        print(f"ray engine (own Ray):    {rayed['tok_s']:>10,.0f} tok/s ({rayed['tokens']:,} tokens in "
              f"{rayed['seconds']:.1f} s, {rayed['rows']:,} rows; Ray start-up included)", flush=True)
        cold, warm, per_task = task_overhead(tmp, args)
        print(f'fixed costs (64 tiny documents as 64 tasks): on a fresh Ray (worker start-up) {cold:.2f} s, '
              f'with warm workers {warm:.2f} s -> {per_task * 1000:.0f} ms of one core per task')
    print(f'1-minute load average before / after: {load[0]:.2f} / {os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
    main()
