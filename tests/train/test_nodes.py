"""Two "nodes" x two ranks on one host: real ``composer`` launchers, gloo on CPU.

Setup, as on a cluster: one launcher per node (``composer --world_size 4 --nproc 2
--node_rank R --base_rank 2R --master_addr 127.0.0.1``), each node with its own local
cache (``cache_root: .../node${oc.env:NODE_RANK,0}``) of one shared remote (local
directories as ``remote:``, read through streaming's downloader as S3 would be).

Why each node runs in its own mount namespace with a private ``/dev/shm``: streaming
registers a node's shared memory under an integer prefix that every rank finds by
scanning ``/dev/shm`` *before* a global ``dist.barrier()`` (``streaming/base/shared/
prefix.py::get_shm_prefix``); after the barrier each node's local leader creates
``/dev/shm/000000_locals``. Two nodes on one host therefore pick the same prefix and the
second leader fails with ``FileExistsError`` -- streaming assumes one ``/dev/shm`` per
node. ``unshare --ipc`` does not help (POSIX shared memory is the ``/dev/shm`` tmpfs, not
SysV IPC), so each node gets ``unshare --mount`` + a fresh tmpfs on ``/dev/shm``, and
its own ``TMPDIR`` (streaming's file locks are keyed by the same prefix). The processes,
launcher, rendezvous and TCP traffic are otherwise real.

The independent reference: the 1-rank run's global batches (every rank slices the one
global order, so the 4-rank run's global batches are the 1-rank run's, in order).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from distributed_helpers import checkpoint
from helpers import ROOT, SAMPLES, SMALL_SEQ, free_port, tiny_run_config
from train_helpers import sample_log

pytestmark = pytest.mark.skipif(shutil.which('unshare') is None or os.geteuid() != 0,
                                reason='needs root and unshare for a private /dev/shm per node')

BATCH = 8          # global batch: 2 per rank on 4 ranks, 4 on 2, 8 on 1
STOP = 5           # checkpoint (mid epoch 0) that the elastic resumes start from
TIMEOUT = 240      # seconds per training (runs take 10-60 s on 2 busy cores)


@pytest.fixture(scope='module')
def remote(small_streams, tmp_path_factory) -> dict[str, str]:
    """The shared "remote": arxiv + a second paper (pretrain) and Dolly (finetune)."""
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
    root = tmp_path_factory.mktemp('remote')
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        f.readline()
        paper = json.loads(f.readline())['text'][:10000]
    (root / 'paper2.jsonl').write_text(json.dumps({'text': paper}) + '\n', encoding='utf-8')
    convert_pretrain([str(root / 'paper2.jsonl')], str(root / 'paper2'),
                     PretrainOptions(max_seq_len=SMALL_SEQ, workers=1, size_limit='4kb'))
    return {'arxiv': str(small_streams['arxiv']), 'dolly': str(small_streams['dolly']),
            'paper2': str(root / 'paper2')}


def loader(remote: dict[str, str], cache: Path, **knobs) -> dict:
    return {'streams': {'arxiv': {'remote': remote['arxiv'], 'repeat': 0.5},  # fractional
                        'dolly': {'remote': remote['dolly']},                # finetune
                        'paper2': {'remote': remote['paper2']}},
            'cache_root': str(cache) + '/node${oc.env:NODE_RANK,0}', 'shuffle_seed': 11,
            'num_workers': 0, **knobs}


@pytest.fixture(scope='module')
def mixer(remote, tmp_path_factory):
    """The mixer of the runs' streams (for the plan, and for replaying the epoch's order)."""
    from foundrymix.loader.mixer import StreamMixer
    return StreamMixer.from_dict(loader(remote, tmp_path_factory.mktemp('plan-cache')))


@pytest.fixture(scope='module')
def plan(mixer):
    """The plan for 2 nodes x 2 ranks (and the run length: one epoch and 2 batches more)."""
    p = mixer.plan(BATCH // 4, '1ep', world_size=4, nodes=2)
    assert p.epoch_size % BATCH == 0 and p.batches_per_epoch > STOP + 2
    return p


def write_config(d: Path, remote: dict[str, str], n_batches: int, **top) -> Path:
    callbacks = {'sample_log': {'path': str(d / 'samples.jsonl')},
                 'stream_accounting': {'out_dir': str(d / 'report'), 'plot': False}}
    cfg = tiny_run_config(loader(remote, d / 'cache'), run_name='nodes', global_train_batch_size=BATCH,
                          max_duration=f'{n_batches}ba', save_folder=str(d / 'ckpt'),
                          save_interval=f'{STOP}ba', callbacks=callbacks)
    cfg.update(top)
    (d / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return d / 'c.yaml'


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / 'composer'
    return [str(script)] if script.exists() else [sys.executable, '-m', 'composer.cli.launcher']


def _node_cmd(d: Path, node: int, nodes: int, nproc: int, port: int, args: list[str]) -> list[str]:
    """One node's launcher in its own mount namespace with a private /dev/shm and TMPDIR."""
    tmp = d / f'tmp-node{node}-{port}'
    tmp.mkdir(parents=True, exist_ok=True)
    launch = _launcher() + [
        '--world_size', str(nodes * nproc), '--nproc', str(nproc), '--node_rank', str(node),
        '--base_rank', str(node * nproc), '--master_addr', '127.0.0.1', '--master_port', str(port),
        '--stdout', str(d / f'node{node}-rank{{rank}}.out'),
        '--stderr', str(d / f'node{node}-rank{{rank}}.err'), str(ROOT / 'train.py'), *args]
    inner = ('mount -t tmpfs -o size=512m tmpfs /dev/shm && TMPDIR=' + str(tmp) + ' exec '
             + ' '.join(f"'{a}'" for a in launch))
    return ['unshare', '--mount', '--propagation', 'private', 'sh', '-c', inner]


def train(d: Path, config: Path, *overrides: str, nodes: int = 1, nproc: int = 1) -> str:
    """Run on ``nodes`` x ``nproc`` ranks (one launcher per node); returns stdout+stderr."""
    port = free_port()
    args = [str(config), *overrides]
    if nodes == 1 and nproc == 1:
        cmds = [[sys.executable, str(ROOT / 'train.py'), *args]]
    else:
        cmds = [_node_cmd(d, n, nodes, nproc, port, args) for n in range(nodes)]
    env = {**os.environ, 'PYTHONFAULTHANDLER': '1'}  # SIGABRT on a hang prints every stack
    procs = [subprocess.Popen(c, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for c in cmds]
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    except subprocess.TimeoutExpired:
        outs = [_abort(p) for p in procs]
    text = '\n'.join(outs) + ''.join(f'\n--- {p.name}\n{p.read_text()[-3000:]}'
                                     for p in sorted(d.glob('node*-rank*.err')))
    if any(p.returncode for p in procs):
        raise AssertionError(f'training failed ({[p.returncode for p in procs]}):\n{text[-8000:]}')
    return text


def _descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f'/proc/{pid}/task').glob('*'):
        for child in (task / 'children').read_text().split():
            out += [int(child)] + _descendants(int(child))
    return out


def _abort(proc: subprocess.Popen) -> str:
    """A hung launcher: SIGABRT its ranks (faulthandler prints their stacks), then kill it."""
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    try:
        return proc.communicate(timeout=20)[0] + '\n[hung: ranks aborted after timeout]'
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] + '\n[hung: killed after timeout]'


def batch_sets(log: list[dict]) -> list[Counter]:
    return [Counter(b['sample_ids']) for b in log]


@pytest.fixture(scope='module')
def one_rank(tmp_path_factory, remote, plan) -> dict:
    d = tmp_path_factory.mktemp('one-rank')
    train(d, write_config(d, remote, plan.batches_per_epoch + 2))
    return {'dir': d, 'log': sample_log(d / 'samples.jsonl')}


@pytest.fixture(scope='module')
def four_ranks(tmp_path_factory, remote, plan) -> dict:
    d = tmp_path_factory.mktemp('four-ranks')
    train(d, write_config(d, remote, plan.batches_per_epoch + 2), nodes=2, nproc=2)
    return {'dir': d, 'log': sample_log(d / 'samples.jsonl')}


def epoch_order(config, infos, batch_size: int, topology) -> list:
    """The global batches (sample ids, numbered stream by stream in config order) of epoch 0
    as the loader trains them on ``topology``."""
    import numpy as np

    from foundrymix.plan.mixture import _plan_epoch
    planned = _plan_epoch(config, infos, batch_size, topology, 'main')
    offsets = np.concatenate(([0], np.cumsum([i.rows for i in infos])[:-1])).astype(np.int64)
    out = []
    for b in range(planned.batches):
        streams, rows = planned.order.batch(b)
        out.append(offsets[streams] + rows)
    return out


@pytest.mark.slow  # 1 rank and 2 nodes x 2 ranks
def test_four_ranks_on_two_nodes_train_the_plan_once(plan, mixer, one_rank, four_ranks):
    from foundrymix.plan.mixture import Topology
    log4, log1 = four_ranks['log'], one_rank['log']
    epoch = [b for b in log4 if b['epoch'] == 0]
    assert len(epoch) == plan.batches_per_epoch and len(log4) == plan.batches_per_epoch + 2
    ids = [i for b in epoch for i in b['sample_ids']]
    assert len(ids) == len(set(ids)) == plan.epoch_size        # no sample id twice
    sim = epoch_order(mixer.config, mixer.infos(), BATCH // 4, Topology(2, 2))
    assert [b['sample_ids'] for b in epoch] == [b.tolist() for b in sim]
    per_stream = Counter(b for batch in epoch for b in batch['stream_ids'])
    names = [s.name for s in plan.streams]
    assert {names[k]: v for k, v in per_stream.items()} == {
        s.name: s.trained_rows_per_epoch for s in plan.streams}
    for r in plan.per_rank:  # each rank's share, from its slice of every global batch
        got = Counter(names[s] for b in epoch for s in b['stream_ids'][r.rank * 2:(r.rank + 1) * 2])
        assert dict(got) == {n: c for n, c in r.rows_per_stream.items() if c}
    assert [b['sample_ids'] for b in log4] == [b['sample_ids'] for b in log1]  # every batch
    assert len(checkpoint(four_ranks['dir'] / 'ckpt' / f'ep0-ba{STOP}-rank0.pt')['rng']) == 4


def resume(tmp_path: Path, source: dict, remote, plan, nodes: int, nproc: int) -> list[dict]:
    d = tmp_path / f'resumed-{nodes}x{nproc}'
    d.mkdir()  # the log up to the checkpoint, as the interrupted run left it
    (d / 'samples.jsonl').write_text(''.join(json.dumps(b) + '\n' for b in source['log'][:STOP]))
    cfg = write_config(d, remote, plan.batches_per_epoch + 2)
    ckpt = source['dir'] / 'ckpt' / f'ep0-ba{STOP}-rank0.pt'
    train(d, cfg, f'load_path={ckpt}', 'save_interval=1000ba', nodes=nodes, nproc=nproc)
    return sample_log(d / 'samples.jsonl')


@pytest.mark.slow  # resumes on 2 ranks (1 node) and 1 rank from the 2 x 2 checkpoint; 1 -> 2 x 2
@pytest.mark.parametrize('source, nodes, nproc', [('four', 1, 2), ('four', 1, 1), ('one', 2, 2)])
def test_elastic_resume_keeps_every_global_batch(tmp_path, remote, plan, one_rank, four_ranks,
                                                 source, nodes, nproc):
    src = four_ranks if source == 'four' else one_rank
    log = resume(tmp_path, src, remote, plan, nodes, nproc)
    assert [b['batch'] for b in log] == list(range(plan.batches_per_epoch + 2))
    assert [b['sample_ids'] for b in log] == [b['sample_ids'] for b in one_rank['log']]  # across the epoch too
    assert [b['epoch'] for b in log] == [b['epoch'] for b in one_rank['log']]


@pytest.mark.slow  # two 1-rank resumes that stop before the first batch
@pytest.mark.parametrize('override, message', [
    ('train_loader.num_canonical_nodes=2',
     "train_loader.num_canonical_nodes: streaming's sampler knob, which foundrymix's own sample "
     'order replaced'),
    ('global_train_batch_size=4',
     'global_train_batch_size: the checkpoint was trained with a global batch of 8 rows, this '
     'run has 4'),
])
def test_resume_changing_ncn_or_global_batch_is_refused(tmp_path, remote, plan, one_rank,
                                                        override, message):
    d = tmp_path / 'refused'
    d.mkdir()
    cfg = write_config(d, remote, plan.batches_per_epoch + 2)
    ckpt = one_rank['dir'] / 'ckpt' / f'ep0-ba{STOP}-rank0.pt'
    with pytest.raises(AssertionError) as e:
        train(d, cfg, f'load_path={ckpt}', override)
    assert message in str(e.value)
