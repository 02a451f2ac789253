"""What the trainer's ``StopTogether`` costs: the ranks agreeing before each batch.

Two real ranks (processes, a gloo process group, ``RANK``/``WORLD_SIZE`` as a launcher sets
them) read the same run of ``--batches`` global batches from a synthetic stream through
the run's loader (``num_workers: 2``), rounds alternating ``off`` (no agreement, the
baseline) and ``on`` (``read_together(loader, StopTogether())``): off, on, off, on ...
Printed: each mode's median seconds per batch and ``on``'s ratio to ``off`` of the same run,
and what one agreement costs on its own (``--calls`` of them, no reading).

    .venv/bin/python benchmarks/bench_together.py [--batches 2000] [--rounds 3]

A training step is far longer than a batch read here, so this is the cost's upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')

RANK = '''
import json, sys, time
import torch.distributed as dist
from foundrymix.loader.run_loader import StagedDataLoader
from foundrymix.train.together import StopTogether, read_together
from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.stages import plan_run
from foundrymix.plan.topology import Topology
job = json.loads(sys.argv[1])
dist.init_process_group('gloo')
batch = job['global_batch'] // 2
config = LoaderConfig.from_dict({'streams': {'s': {'local': job['data']}}, 'num_workers': 2})
run, _ = plan_run(config, batch, f"{job['batches']}ba", Topology(nodes=1, ranks_per_node=2))
times = {'off': [], 'on': []}
for _ in range(job['rounds']):
    for mode in times:
        loader = StagedDataLoader(run)
        loader.prepare()
        dist.barrier()
        start = time.perf_counter()
        n = sum(1 for _ in (read_together(loader, StopTogether()) if mode == 'on' else loader))
        times[mode].append((time.perf_counter() - start) / n)
        loader.release()
agree = StopTogether()
agree(None)  # the group made
dist.barrier()
start = time.perf_counter()
for _ in range(job['calls']):
    agree(None)
call = (time.perf_counter() - start) / job['calls']
if dist.get_rank() == 0:
    print(json.dumps({'times': times, 'call': call}))
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--batches', type=int, default=2000)
    ap.add_argument('--global-batch', type=int, default=8)
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--calls', type=int, default=5000)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix='fmx-bench-together-')
    try:
        sys.path.insert(0, os.path.join(ROOT, 'tests'))
        from mix_helpers import build_stream
        data = os.path.join(root, 's')
        build_stream(data, 'pretrain', args.batches * args.global_batch, 0, 512, size_limit=1 << 20)
        job = json.dumps({'data': data, 'batches': args.batches, 'global_batch': args.global_batch,
                          'rounds': args.rounds, 'calls': args.calls})
        port = str(free_port())
        procs = []
        for rank in range(2):
            env = {**os.environ, 'PYTHONPATH': os.path.abspath(ROOT), 'RANK': str(rank),
                   'LOCAL_RANK': str(rank), 'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2',
                   'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': port,
                   'FOUNDRYMIX_CACHE': os.path.join(root, 'cache')}
            procs.append(subprocess.Popen([sys.executable, '-c', RANK, job], env=env,
                                          stdout=subprocess.PIPE, text=True))
        out = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            print('a rank failed', file=sys.stderr)
            return 1
        result = json.loads(out[0].strip().splitlines()[-1])
        off, on = (statistics.median(result['times'][m]) for m in ('off', 'on'))
        print(f"2 ranks, {args.batches} batches of {args.global_batch} rows, {args.rounds} rounds (A-B-A)")
        print(f'off  {off * 1e6:8.1f} us/batch  [{", ".join(f"{t * 1e6:.1f}" for t in result["times"]["off"])}]')
        print(f'on   {on * 1e6:8.1f} us/batch  [{", ".join(f"{t * 1e6:.1f}" for t in result["times"]["on"])}]'
              f'  {on / off:.3f} x off')
        print(f"one agreement alone: {result['call'] * 1e6:.1f} us")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
