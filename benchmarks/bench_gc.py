"""Does each garbage-collector device earn its place? A-B-A against the same run without it.

The devices, each switched off in a child process (before foundrymix is imported, so every
user of the device sees it off) and run alternately with it on: on, off, on, off, ...

* ``paused``: ``foundrymix.heap.collector_paused`` over reading the config, the plan record
  and the loader's objects. Timed: ``load_config`` + the trainer's ``_train_data`` over N
  streams (a restart: the cache is warm).
* ``freeze``: ``gc.collect(); gc.freeze()`` after the build (what ``builder.freeze_built_heap``
  did; removed). Timed: the first batch through 2 forked DataLoader workers, and the time the
  collector spends (``gc.callbacks``) over the next ``--batches`` batches in the main process.
* ``release``: a ``gc.collect()`` before the stage's store is released (what
  ``StagedDataLoader.release`` did; removed). Timed: a stage switch (release + next stage's
  build + its first batch), and the collect alone.

    .venv/bin/python benchmarks/bench_gc.py [--streams 2000] [--rounds 3]

Prints one line per device: median [range] on and off, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale as bs  # noqa: E402  (its stream and config builders, its child runner)

CHILD = r'''
import contextlib, gc, json, os, sys, time
device, on, cfg_path = sys.argv[1], sys.argv[2] == 'on', sys.argv[3]
if device == 'paused' and not on:
    import foundrymix.heap
    @contextlib.contextmanager
    def _off():
        yield
    foundrymix.heap.collector_paused = _off
from foundrymix.train.config import load_config, split_batch
from foundrymix.train import builder
from foundrymix.loader import run_loader
if device == 'release' and on:
    _release = run_loader.StagedDataLoader.release
    def _collect_first(self):
        gc.collect()
        _release(self)
    run_loader.StagedDataLoader.release = _collect_first
out = {}
t0 = time.perf_counter()
cfg = load_config(cfg_path)
device_batch, _ = split_batch(cfg, 1)
data = builder._train_data(cfg, device_batch)
out['build_s'] = time.perf_counter() - t0
if device == 'freeze' and on:
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    out['freeze_s'] = time.perf_counter() - t
spent = [0.0]
def _timer(phase, info, _t=[0.0]):
    if phase == 'start':
        _t[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - _t[0]
gc.callbacks.append(_timer)
t = time.perf_counter()
it = iter(data.loader)
next(it)
out['first_batch_s'] = time.perf_counter() - t
if device == 'freeze':
    spent[0] = 0.0
    t = time.perf_counter()
    for _ in range(int(sys.argv[4])):
        next(it)
    out['batches_s'] = time.perf_counter() - t
    out['gc_s'] = spent[0]
if device == 'release':
    t = time.perf_counter()
    while data.loader.position.batch < data.run.stages[1].start_batch + 1:
        next(it)
    out['switch_s'] = time.perf_counter() - t
    t = time.perf_counter()
    gc.collect()
    out['collect_s'] = time.perf_counter() - t
print(json.dumps(out))
'''

#: what is compared for each device
MEASURE = {'paused': 'build_s', 'freeze': 'gc_s', 'release': 'switch_s'}


def fmt(values: list[float]) -> str:
    return f'{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--streams', type=int, default=2000)
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--batches', type=int, default=200)
    ap.add_argument('--seq-len', type=int, default=256)
    ap.add_argument('--devices', nargs='*', default=list(MEASURE))
    args = ap.parse_args()
    bs.HASH_LOCAL = False  # the shards' hashes are not what is measured
    work = tempfile.mkdtemp(prefix='fmx-bench-gc-')
    try:
        template = bs.convert_template(work, args.seq_len)
        case = os.path.join(work, 'case')
        dirs = bs.linked_streams(case, template, args.streams)
        for device in args.devices:
            cfg = os.path.join(case, f'{device}.yaml')
            if device == 'release':
                bs.write_config(cfg, dirs, args.seq_len, '1ba', stages=2)
            else:
                bs.write_config(cfg, dirs, args.seq_len, f'{args.batches + 2}ba')
            if device == 'freeze':  # forked DataLoader workers: what freezing before fork is for
                import yaml
                y = yaml.safe_load(open(cfg))
                y['train_loader']['num_workers'] = 2
                yaml.safe_dump(y, open(cfg, 'w'), sort_keys=False)
            env = bs.case_env(case)
            cmd = [bs.PY, '-c', CHILD, device, 'on', cfg, str(args.batches)]
            bs.run_wait4(cmd, cwd=case, env=env)  # warm-up: the cache's records, the page cache
            got: dict = {'on': [], 'off': []}
            for _ in range(args.rounds):
                for state in ('on', 'off'):
                    cmd[4] = state
                    _, _, out = bs.run_wait4(cmd, cwd=case, env=env)
                    got[state].append(json.loads(out.strip().splitlines()[-1]))
            key = MEASURE[device]
            on = [g[key] for g in got['on']]
            off = [g[key] for g in got['off']]
            extra = ''
            if device == 'release':
                extra = f"; the collect alone {fmt([g['collect_s'] for g in got['on']])} s"
            if device == 'freeze':
                extra = (f"; first batch on {fmt([g['first_batch_s'] for g in got['on']])} s, off "
                         f"{fmt([g['first_batch_s'] for g in got['off']])} s; the freeze itself "
                         f"{fmt([g['freeze_s'] for g in got['on']])} s")
            print(f'{device:8s} {args.streams} streams, {key}: on {fmt(on)} s, off {fmt(off)} s, '
                  f'on/off {statistics.median(on) / max(statistics.median(off), 1e-9):.2f}{extra}; '
                  f'load {os.getloadavg()[0]:.1f}', flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
