"""Scale: `foundrymix plan` and the trainer's loader start-up over many streams, against
a raw ``StreamingDataset`` over the same streams, in the same run.

Two kinds of case (issue 22):

* **plan** (``--plan N:ROWS``): N streams of ROWS rows each, written as real manifests and
  ``index.json`` files whose shard files are *sparse* (``truncate`` to the indexed size:
  the plan reads manifests and indexes only, never shard bytes). Measures the whole
  ``foundrymix plan --json`` command: wall time and peak RSS (``wait4``), and its time
  after its imports; against raw streaming's start over the same streams (its dataset and
  its first batch's work, up to the first row read: the shards are holes), alternating.
* **start** (``--start N``): one real stream converted from the bundled arXiv sample at
  ``--seq-len`` (1,409 rows at 256 tokens), hard-linked into N stream directories.
  Measures, each in a fresh process after its imports: the trainer's loader path
  (``load_config`` + the trainer's ``_train_data``: plan, checks, loader) + the first
  batch, against ``StreamingDataset(streams=[Stream(local=d) ...])`` + its first batch
  through a ``DataLoader`` -- the least a raw streaming user does. Alternating (raw,
  foundrymix, raw, ...) so machine noise hits both alike; median [range] of ``--rounds``.
  Also open file descriptors after the first batch, and peak RSS. Each case has a cache
  directory of its own (``FOUNDRYMIX_CACHE``): round 1 is a *first start* (foundrymix hashes
  the shards and records the plan and the tokenizer fingerprint), rounds 2.. are
  *restarts* over unchanged inputs (a resume, a re-launch); both are printed. And a fresh
  temporary directory (``TMPDIR``) of its own, as on a clean machine (:func:`case_env`;
  ``--shared-tmp`` for the machine's own).

    .venv/bin/python benchmarks/bench_scale.py [--plan 10:100000 1000:10000 ...]
        [--start 10 100 1000] [--rounds 3]

Prints a table; the ratio column is foundrymix / raw (issue 22 targets: plan over 1,000
streams x 10k rows under 0.25x raw start-up; loader start-up at most 1.1x raw).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1',
           TOKENIZERS_PARALLELISM='false')

#: whether each case's processes get a fresh temporary directory (``--shared-tmp`` unsets it)
CASE_TMP = True
#: whether foundrymix's side hashes local shards at a first start (``--no-hash`` unsets it:
#: what a first start costs besides that one read of the data)
HASH_LOCAL = True
#: whether every round of a start case is a first start (``--first-starts``: a fresh cache
#: directory each round) rather than round 1 only
FIRST_STARTS = False


def case_env(case: str, **extra: str) -> dict:
    """The environment of a case's processes, foundrymix's and raw streaming's alike.

    By default ``TMPDIR`` is a fresh directory of the case's own, as on a clean machine:
    streaming 0.13 leaves two filelocks there per dataset that ever ran and its prefix scan
    tests them all, so on a long-used machine (this one held ~11,000 dead prefixes) that
    scan is most of a raw start and hides the rest (foundrymix's loader has no such scan).
    ``--shared-tmp`` measures on the
    machine's own temporary directory instead."""
    env = dict(ENV, **extra)
    if CASE_TMP:
        tmp = os.path.join(case, 'tmp')
        os.makedirs(tmp, exist_ok=True)
        env['TMPDIR'] = tmp
    return env


def dead_prefixes() -> int:
    """streaming filelocks (barrier and cache) in the machine's temporary directory."""
    return sum(n.endswith(('_barrier_filelock', '_cache_filelock'))
               for n in os.listdir(tempfile.gettempdir()))


#: rows per synthetic shard (foundrymix's 64 MB default holds ~120k rows of 256 uint16 tokens)
ROWS_PER_SHARD = 100_000


def run_wait4(cmd: list[str], cwd: str, env: Optional[dict] = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GB from ``wait4``, stdout) of ``cmd`` as a child process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or ENV, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f'{" ".join(cmd[:4])}... failed ({proc.returncode}):\n{err.read()[-3000:]}')
        return wall, usage.ru_maxrss / 1e6, out.read()  # ru_maxrss is KiB on Linux


# ------------------------------------------------------------------- data for plan cases
def write_sparse_stream(template: str, out: str, rows: int) -> None:
    """A stream of ``rows`` rows shaped like ``template`` (manifest + index), shards sparse."""
    manifest = json.load(open(os.path.join(template, 'foundrymix.json')))
    index = json.load(open(os.path.join(template, 'index.json')))
    shard = index['shards'][0]
    per_row = shard['raw_data']['bytes'] / shard['samples']
    os.makedirs(out)
    shards = []
    for i, start in enumerate(range(0, rows, ROWS_PER_SHARD)):
        n = min(ROWS_PER_SHARD, rows - start)
        entry = json.loads(json.dumps(shard))
        entry['samples'] = n
        entry['raw_data'] = {'basename': f'shard.{i:05d}.mds', 'bytes': int(per_row * n) + 8,
                             'hashes': {}}
        with open(os.path.join(out, entry['raw_data']['basename']), 'wb') as f:
            f.truncate(entry['raw_data']['bytes'])
        shards.append(entry)
    json.dump({'shards': shards, 'version': 2}, open(os.path.join(out, 'index.json'), 'w'))
    manifest.get('options', {}).pop('hashes', None)  # the sparse shards have none recorded
    tokens = rows * manifest['max_seq_len']
    manifest['counts'].update(rows=rows, tokens=tokens, loss_tokens=tokens, documents_read=rows,
                              documents_written=rows, tail_tokens=0)
    json.dump(manifest, open(os.path.join(out, 'foundrymix.json'), 'w'))


def write_config(path: str, stream_dirs: dict[str, str], seq_len: int, max_duration: str,
                 repeat: float = 1, stages: int = 0) -> None:
    """A training YAML (yamls/demo.yaml's model and optimizer) over ``stream_dirs``
    (``hash_local_shards: false`` with ``--no-hash``)."""
    import yaml
    cfg = yaml.safe_load(open(os.path.join(ROOT, 'yamls', 'demo.yaml')))
    cfg.pop('variables')
    cfg.pop('callbacks')
    cfg['max_seq_len'] = seq_len
    cfg['model']['max_position_embeddings'] = seq_len
    streams = {n: {'local': d, 'repeat': repeat} for n, d in stream_dirs.items()}
    cfg['train_loader']['streams'] = streams
    if not HASH_LOCAL:
        cfg['train_loader']['hash_local_shards'] = False
    cfg['max_duration'] = max_duration
    if stages:  # the same streams, one stage after another: a switch rebuilds the dataset
        cfg['train_loader']['stages'] = [{'name': f'st{i}', 'duration': max_duration,
                                          'streams': streams} for i in range(stages)]
        del cfg['train_loader']['streams'], cfg['max_duration']
    cfg['save_folder'] = os.path.join(os.path.dirname(path), 'ckpt')
    with open(path, 'w') as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


def convert_template(work: str, seq_len: int) -> str:
    out = os.path.join(work, 'template')
    subprocess.run([PY, '-m', 'foundrymix.cli', 'convert', 'pretrain',
                    os.path.join(ROOT, 'data', 'samples', 'arxiv_sample.jsonl'), '--out', out,
                    '--max-seq-len', str(seq_len)], env=ENV, check=True, capture_output=True)
    return out


# --------------------------------------------------------------------- start-up children
RAW = r'''
import os, sys, time, json
from streaming import Stream, StreamingDataset
from torch.utils.data import DataLoader, default_collate
dirs = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
ds = StreamingDataset(streams=[Stream(local=d) for d in dirs], batch_size=8, shuffle=True,
                      shuffle_seed=17, batching_method='random')
loader = DataLoader(ds, batch_size=8, num_workers=0,
                    collate_fn=lambda s: default_collate([r['input_ids'] for r in s]))
it = iter(loader)
if sys.argv[2:] == ['sparse']:  # the plan cases' shard files are holes: timed up to the first
    try:                         # row read (the epoch's partition and shuffle done), which fails
        next(it)
    except IndexError:  # 'Relative sample index ... is not present': the hole where the row would be
        pass
    else:
        raise SystemExit('the sparse shards gave a row')
else:
    next(it)
print(json.dumps({'seconds': time.perf_counter() - t0, 'fds': len(os.listdir('/proc/self/fd'))}))
'''

OURS = r'''
import os, sys, time, json
from foundrymix.train.config import load_config, split_batch
from foundrymix.train import builder
t0 = time.perf_counter()
cfg = load_config(sys.argv[1])
device_batch, _ = split_batch(cfg, 1)
data = builder._train_data(cfg, device_batch)
at = int(sys.argv[2]) if len(sys.argv) > 2 else 0
if at:  # resume: what load_state_dict sets once the checkpoint's fingerprints match
    data.loader.position.batch = at
it = iter(data.loader)  # held: dropping it mid-epoch releases the stage (gc.collect)
next(it)
out = {'seconds': time.perf_counter() - t0, 'fds': len(os.listdir('/proc/self/fd'))}
if len(sys.argv) > 3:  # a stage switch: the next stage's first batch
    t1 = time.perf_counter()
    while data.loader.position.batch < data.run.stages[1].start_batch + 1:
        next(it)
    out['switch_seconds'] = time.perf_counter() - t1
print(json.dumps(out))
'''

#: ``foundrymix plan --json CONFIG`` as the command runs it (``foundrymix.cli.main``), with
#: the time after its imports printed on a last line of its own
PLAN_TIMED = r'''
import json, sys, time
import foundrymix.cli
# what the command imports before it plans: its parser's modules, the YAML reader, the plan
# (streaming and torch: what raw streaming's side imports before its clock starts)
import omegaconf
import foundrymix.plan.stages, foundrymix.tools.plan, foundrymix.train.config
foundrymix.cli.build_parser()
t0 = time.perf_counter()
code = foundrymix.cli.main(['plan', '--json', sys.argv[1]])
sys.stdout.flush()
print(json.dumps({'seconds': time.perf_counter() - t0}))
sys.exit(code)
'''

RAW_AT = r'''
import os, sys, time, json
from streaming import Stream, StreamingDataset
from torch.utils.data import DataLoader, default_collate
dirs, repeat, at = json.load(open(sys.argv[1])), float(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
ds = StreamingDataset(streams=[Stream(local=d, repeat=repeat) for d in dirs], batch_size=8,
                      shuffle=True, shuffle_seed=17, batching_method='random')
if at:
    ds.load_state_dict({'epoch': 0, 'sample_in_epoch': at * 8, 'num_canonical_nodes': 1,
                        'shuffle_seed': 17, 'initial_physical_nodes': None})
loader = DataLoader(ds, batch_size=8, num_workers=0,
                    collate_fn=lambda s: default_collate([r['input_ids'] for r in s]))
next(iter(loader))
print(json.dumps({'seconds': time.perf_counter() - t0}))
'''


def linked_streams(case: str, template: str, n: int) -> dict[str, str]:
    """``n`` stream directories, each hard links of ``template``'s files."""
    dirs = {}
    for i in range(n):
        d = os.path.join(case, 'streams', f's{i:05d}')
        os.makedirs(d)
        for name in os.listdir(template):
            os.link(os.path.join(template, name), os.path.join(d, name))
        dirs[f's{i:05d}'] = d
    return dirs


def resume_case(work: str, template: str, rows: int, at: int, rounds: int, seq_len: int,
                template_rows: int, streams: int = 10) -> dict:
    """Start (batch 0) and resume at batch ``at`` of one ``rows``-row epoch (``streams``
    linked streams with ``repeat``), foundrymix's trainer path and raw streaming alike."""
    case = os.path.join(work, f'resume-{rows}')
    dirs = linked_streams(case, template, streams)
    repeat = rows / (streams * template_rows)
    cfg = os.path.join(case, 'train.yaml')
    write_config(cfg, dirs, seq_len, f'{rows // 8}ba', repeat=repeat)
    dir_list = os.path.join(case, 'dirs.json')
    json.dump(list(dirs.values()), open(dir_list, 'w'))
    got: dict = {k: [] for k in ('raw_start', 'raw_resume', 'ours_start', 'ours_resume')}
    rss: dict = {k: [] for k in got}
    for _ in range(rounds):
        for key, cmd in (('raw_start', [PY, '-c', RAW_AT, dir_list, str(repeat), '0']),
                         ('ours_start', [PY, '-c', OURS, cfg, '0']),
                         ('raw_resume', [PY, '-c', RAW_AT, dir_list, str(repeat), str(at)]),
                         ('ours_resume', [PY, '-c', OURS, cfg, str(at)])):
            _, peak, out = run_wait4(cmd, cwd=case, env=case_env(case))
            got[key].append(json.loads(out.strip().splitlines()[-1])['seconds'])
            rss[key].append(peak)
    shutil.rmtree(case)
    return {'rows': rows, 'at': at, **got, 'rss_gb': {k: max(v) for k, v in rss.items()}}


def switch_case(work: str, template: str, n: int, rounds: int, seq_len: int) -> dict:
    """Two stages over the same ``n`` linked streams, one batch each: the start (build + first
    batch) against the switch (release + build of the next stage + its first batch)."""
    case = os.path.join(work, f'switch-{n}')
    dirs = linked_streams(case, template, n)
    cfg = os.path.join(case, 'train.yaml')
    write_config(cfg, dirs, seq_len, '1ba', stages=2)
    start, switch = [], []
    for _ in range(rounds):
        _, _, out = run_wait4([PY, '-c', OURS, cfg, '0', 'switch'], cwd=case, env=case_env(case))
        got = json.loads(out.strip().splitlines()[-1])
        start.append(got['seconds'])
        switch.append(got['switch_seconds'])
    shutil.rmtree(case)
    return {'streams': n, 'start_s': start, 'switch_s': switch}


def start_case(work: str, template: str, n: int, rounds: int, seq_len: int) -> dict:
    case = os.path.join(work, f'start-{n}')
    dirs = linked_streams(case, template, n)
    cfg = os.path.join(case, 'train.yaml')
    write_config(cfg, dirs, seq_len, '1ba')
    dir_list = os.path.join(case, 'dirs.json')
    json.dump(list(dirs.values()), open(dir_list, 'w'))
    raw, ours, rss_raw, rss_ours, fds = [], [], [], [], {}
    # A cache directory of the case's own: round 1 is a first start (foundrymix hashes every
    # shard, plans and records the plan and the tokenizer's fingerprint), later rounds are
    # restarts over unchanged inputs (they read those records).
    # With --first-starts, every round has a cache directory of its own: all are first starts.
    env = case_env(case, FOUNDRYMIX_CACHE=os.path.join(case, 'cache'))
    for i in range(rounds):
        if FIRST_STARTS:
            env = dict(env, FOUNDRYMIX_CACHE=os.path.join(case, f'cache-{i}'))
        for side, code, arg, times, rss in (('raw', RAW, dir_list, raw, rss_raw),
                                            ('ours', OURS, cfg, ours, rss_ours)):
            _, peak, out = run_wait4([PY, '-c', code, arg], cwd=case, env=env)
            got = json.loads(out.strip().splitlines()[-1])
            times.append(got['seconds'])
            rss.append(peak)
            fds[side] = got['fds']
    shutil.rmtree(case)
    return {'streams': n, 'raw_s': raw, 'ours_s': ours, 'raw_rss_gb': max(rss_raw),
            'ours_rss_gb': max(rss_ours), 'fds': fds}


def plan_case(work: str, template: str, n: int, rows: int, rounds: int, seq_len: int,
              duration: str = '1ep') -> dict:
    """``foundrymix plan --json`` over ``n`` sparse streams of ``rows`` rows, against raw
    streaming's start on the same streams (:data:`RAW` with ``sparse``: reading 8 real rows
    is ~1 ms of a start), alternating. Each side is
    timed twice: the whole process (interpreter and imports included) and, inside it, the
    work after its imports -- the issue's 0.25x target is read on the second (imports are
    paid once per process whatever it does; ~2-5 s here, torch's most of it)."""
    case = os.path.join(work, f'plan-{n}x{rows}')
    dirs = {}
    for i in range(n):
        d = os.path.join(case, 'streams', f's{i:05d}')
        write_sparse_stream(template, d, rows)
        dirs[f's{i:05d}'] = d
    cfg = os.path.join(case, 'train.yaml')
    write_config(cfg, dirs, seq_len, duration)
    dir_list = os.path.join(case, 'dirs.json')
    json.dump(list(dirs.values()), open(dir_list, 'w'))
    times, rss, work_s, raw_wall, raw_work = [], [], [], [], []
    env = case_env(case)
    for _ in range(rounds):
        wall, _, out = run_wait4([PY, '-c', RAW, dir_list, 'sparse'], cwd=case, env=env)
        raw_wall.append(wall)
        raw_work.append(json.loads(out.strip().splitlines()[-1])['seconds'])
        wall, peak, out = run_wait4([PY, '-c', PLAN_TIMED, cfg], cwd=case, env=env)
        times.append(wall)
        rss.append(peak)
        text, _, timing = out.rstrip().rpartition('\n')
        work_s.append(json.loads(timing)['seconds'])
    shutil.rmtree(case)
    doc = json.loads(text)
    counted = (doc['stages'][0]['plan'] if 'stages' in doc else doc).get('counted', {})
    return {'streams': n, 'rows': rows, 'duration': duration, 'plan_s': times,
            'plan_rss_gb': max(rss), 'counted': counted, 'plan_work_s': work_s,
            'raw_wall_s': raw_wall, 'raw_work_s': raw_work}


def fmt(values: list[float]) -> str:
    return f'{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--plan', nargs='*', default=['10:100000', '1000:10000'],
                    help='plan cases, STREAMS:ROWS_PER_STREAM[:MAX_DURATION] (default 1ep; e.g. '
                         '10:100000000:1000000ba ends a 10^9-row epoch at batch 10^6)')
    ap.add_argument('--start', nargs='*', type=int, default=[10, 100, 1000],
                    help='start-up cases: number of streams (each a hard link of one real stream)')
    ap.add_argument('--resume', nargs='*', default=[],
                    help='resume cases, ROWS:BATCH: start vs resume at BATCH of a ROWS-row epoch')
    ap.add_argument('--switch', nargs='*', type=int, default=[],
                    help='stage-switch cases: number of streams (two one-batch stages)')
    ap.add_argument('--rounds', type=int, default=3)
    ap.add_argument('--seq-len', type=int, default=256)
    ap.add_argument('--json', default=None, help='also write the results here')
    ap.add_argument('--shared-tmp', action='store_true',
                    help="run the cases with the machine's temporary directory (its dead streaming "
                         'filelocks) instead of a fresh one each')
    ap.add_argument('--no-hash', action='store_true',
                    help="foundrymix's configs set train_loader.hash_local_shards: false (a first "
                         'start without its one read of every local shard)')
    ap.add_argument('--first-starts', action='store_true',
                    help='every round of a start case is a first start (a fresh cache directory '
                         'each): a median of first starts rather than one sample')
    args = ap.parse_args()
    global CASE_TMP, HASH_LOCAL, FIRST_STARTS
    CASE_TMP = not args.shared_tmp
    HASH_LOCAL = not args.no_hash
    FIRST_STARTS = args.first_starts
    with tempfile.TemporaryDirectory(prefix='bench-scale-') as work:
        template = convert_template(work, args.seq_len)
        with open(os.path.join(template, 'foundrymix.json')) as f:
            template_rows = json.load(f)['counts']['rows']
        print(f'load before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cpus; template stream: '
              f'{template_rows:,} rows of {args.seq_len} tokens; temporary directory: '
              f'{"a fresh one per case" if CASE_TMP else tempfile.gettempdir()} '
              f'({dead_prefixes():,} streaming filelocks in {tempfile.gettempdir()}); local shards '
              f'{"hashed at a first start" if HASH_LOCAL else "not hashed (--no-hash)"}', flush=True)
        results = {'plan': [], 'start': [], 'template_rows': template_rows}
        for case in args.plan:
            n, rows, duration = (case.split(':') + ['1ep'])[:3]
            n, rows = int(n), int(rows)
            r = plan_case(work, template, n, rows, args.rounds, args.seq_len, duration)
            results['plan'].append(r)
            ratio = [p / w for p, w in zip(r['plan_work_s'], r['raw_work_s'])]
            whole = [p / w for p, w in zip(r['plan_s'], r['raw_wall_s'])]
            print(f'plan   {n:>6,} streams x {rows:>11,} rows ({n * rows:>14,}), {duration}: '
                  f'{fmt(r["plan_s"])} s, peak RSS {r["plan_rss_gb"]:.2f} GB; counted '
                  f'{r["counted"]}', flush=True)
            print(f'plan   {n:>6,} streams, after imports: plan {fmt(r["plan_work_s"])} s, raw '
                  f'streaming start {fmt(r["raw_work_s"])} s, ratio {fmt(ratio)}; whole processes: '
                  f'plan {fmt(r["plan_s"])} s, raw {fmt(r["raw_wall_s"])} s, ratio {fmt(whole)}',
                  flush=True)
        for n in args.start:
            r = start_case(work, template, n, args.rounds, args.seq_len)
            results['start'].append(r)
            ratio = [o / w for o, w in zip(r['ours_s'], r['raw_s'])]
            if FIRST_STARTS:
                print(f'start  {n:>6,} streams x {template_rows:,} rows, first starts (a fresh cache '
                      f'each round): foundrymix {fmt(r["ours_s"])} s, raw streaming {fmt(r["raw_s"])} '
                      f's; ratio {fmt(ratio)}', flush=True)
                continue
            print(f'start  {n:>6,} streams x {template_rows:,} rows, first start: foundrymix '
                  f'{r["ours_s"][0]:.2f} s, raw streaming {r["raw_s"][0]:.2f} s, ratio {ratio[0]:.2f}',
                  flush=True)
            if len(ratio) > 1:
                print(f'start  {n:>6,} streams, restarts (rounds 2-{len(ratio)}): foundrymix '
                      f'{fmt(r["ours_s"][1:])} s ({r["ours_rss_gb"]:.2f} GB, {r["fds"]["ours"]} fds), '
                      f'raw streaming {fmt(r["raw_s"][1:])} s ({r["raw_rss_gb"]:.2f} GB, '
                      f'{r["fds"]["raw"]} fds); ratio {fmt(ratio[1:])}', flush=True)
        for case in args.resume:
            rows, at = (int(x) for x in case.split(':'))
            r = resume_case(work, template, rows, at, args.rounds, args.seq_len, template_rows)
            results.setdefault('resume', []).append(r)
            print(f'resume {rows:>14,} rows at batch {at:,}: foundrymix start {fmt(r["ours_start"])} s, '
                  f'resume {fmt(r["ours_resume"])} s; raw streaming start {fmt(r["raw_start"])} s, '
                  f'resume {fmt(r["raw_resume"])} s; peak RSS {r["rss_gb"]}', flush=True)
        for n in args.switch:
            r = switch_case(work, template, n, args.rounds, args.seq_len)
            results.setdefault('switch', []).append(r)
            ratio = [w / s for s, w in zip(r['start_s'], r['switch_s'])]
            print(f'switch {n:>6,} streams: start {fmt(r["start_s"])} s, stage switch '
                  f'{fmt(r["switch_s"])} s; ratio {fmt(ratio)}', flush=True)
        print(f'load after: {os.getloadavg()[0]:.2f}')
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(results, f, indent=2)


if __name__ == '__main__':
    main()
