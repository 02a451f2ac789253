"""Resume proven at every position: for every batch ``k`` of a run, a fresh loader restored at
``k`` yields exactly batches ``k..`` of the straight run.

The strongest loaders (Grain) check every position, not a few chosen ones; a resume bug
that only shows at one batch (the last of an epoch, the first of a stage, inside a
stage's second epoch) is exactly the kind a few spot checks miss. The run: three stages
-- a fractional repeat of a finetune stream, stage switches that change the global batch
(``stages[i].global_train_batch_size``: 4 -> 8 -> 4 rows), an epoch boundary inside the
last stage -- on the bundled sample streams (``small_streams``).

The restore goes through the path Composer uses: the straight run's
``state_dict()`` after batch ``k`` (JSON round-tripped, as a checkpoint stores it;
Composer's ``train_dataloader.dataset`` returns it), then a *new plan* and a *new*
:class:`StagedDataLoader` whose ``load_state_dict`` gets it -- what a resumed process does. The reference is
the straight run's sample ids (and, for two ranks, the one-rank run's global batches:
the ranks must hold the same global batch as one rank does).

Real processes: each configuration runs in fresh interpreters (two ranks: two processes
with a gloo process group, ``RANK``/``WORLD_SIZE`` as a launcher sets them), each with its
own ``TMPDIR``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, free_port

GLOBAL_BATCH = 4

# One rank: the straight run, its position after every batch, then a fresh plan and loader
# restored at every position, read to the end.
CHILD = textwrap.dedent('''
    import json, os, sys
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.topology import Topology
    from foundrymix.plan.stages import plan_run
    from foundrymix.loader.run_loader import StagedDataLoader
    import torch.distributed as dist
    job = json.loads(open(sys.argv[1]).read())
    ranks = int(os.environ.get('WORLD_SIZE', '1'))
    if ranks > 1:
        dist.init_process_group('gloo')
    batch = job['global_batch'] // ranks

    def plan(config):
        run, _ = plan_run(LoaderConfig.from_dict(config), batch, None,
                          Topology(nodes=1, ranks_per_node=ranks))
        return run

    def every_position(config):
        run = plan(config)
        loader = StagedDataLoader(run)
        straight, states = [], [json.loads(json.dumps(loader.state_dict()))]
        for b in loader:
            straight.append(b['sample_id'].tolist())
            states.append(json.loads(json.dumps(loader.state_dict())))
        loader.release()
        del loader
        resumed = []
        for k, state in enumerate(states):
            fresh = StagedDataLoader(plan(config))  # what a resumed process builds
            fresh.load_state_dict(state)
            assert fresh.position.batch == k, (k, fresh.position.batch)
            resumed.append([b['sample_id'].tolist() for b in fresh])
            fresh.release()
            del fresh
        return {'stages': [[s.name, s.start_batch, s.batches, s.plan.batches_per_epoch]
                           for s in run.stages],
                'straight': straight, 'resumed': resumed}

    out = {str(w): every_position({**job['config'], 'num_workers': w}) for w in job['workers']}
    with open(job['out'].format(rank=int(os.environ.get('RANK', '0'))), 'w') as f:
        json.dump(out, f)
''')


def three_stages(data: dict[str, str]) -> dict:
    """pretrain with dolly at 0.25x (ends mid-epoch) -> a mix with twice the global batch
    (``global_train_batch_size: 8``) -> finetune, back to the run's batch, for 2 epochs."""
    return {'streams': {'arxiv': {'local': data['arxiv']}, 'dolly': {'local': data['dolly']}},
            'shuffle_seed': 3,
            'stages': [
                {'name': 'pretrain', 'duration': '5ba',
                 'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.25}}},
                {'name': 'mix', 'duration': '3ba', 'global_train_batch_size': 2 * GLOBAL_BATCH,
                 'streams': {'arxiv': {'repeat': 0.5}, 'dolly': {'repeat': 0.5}}},
                {'name': 'finetune', 'duration': '2ep',
                 'streams': {'dolly': {'repeat': 0.5}, 'arxiv': {'repeat': 0.25}}}]}


def run_ranks(tmp: Path, data: dict[str, str], ranks: int, workers: list[int]) -> dict[int, list[dict]]:
    """num_workers -> every rank's straight run and its restores at every position, from
    ``ranks`` fresh processes (one process per rank does every worker setting)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / 'tmpdir').mkdir(exist_ok=True)
    job = tmp / 'job.json'
    job.write_text(json.dumps({'config': three_stages(data), 'global_batch': GLOBAL_BATCH,
                               'workers': workers, 'out': str(tmp / 'rank{rank}.json')}))
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')]),
               'TMPDIR': str(tmp / 'tmpdir'), 'RANK': str(rank), 'LOCAL_RANK': str(rank),
               'WORLD_SIZE': str(ranks), 'LOCAL_WORLD_SIZE': str(ranks),
               'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': port}
        procs.append(subprocess.Popen([sys.executable, '-c', CHILD, str(job)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f'rank {rank}:\n{err[-4000:]}'
    per_rank = [json.loads((tmp / f'rank{r}.json').read_text()) for r in range(ranks)]
    return {w: [out[str(w)] for out in per_rank] for w in workers}


def assert_every_position_resumes(rank_runs: list[dict]) -> None:
    for rank, out in enumerate(rank_runs):
        straight, resumed = out['straight'], out['resumed']
        assert len(straight) == 20
        assert len(resumed) == len(straight) + 1  # positions 0..20 (20: the finished run)
        for k, tail in enumerate(resumed):
            assert tail == straight[k:], f'rank {rank}: restored at batch {k}'


@pytest.fixture(scope='module')
def data(small_streams) -> dict[str, str]:
    return {name: str(path) for name, path in small_streams.items()}


@pytest.fixture(scope='module')
def one_rank(tmp_path_factory, data) -> dict[int, list[dict]]:
    """One rank, without workers and with two DataLoader workers (one process)."""
    return run_ranks(tmp_path_factory.mktemp('one-rank'), data, 1, [0, 2])


def test_the_positions_cover_stage_switches_and_an_epoch_inside_a_stage(one_rank):
    """A stage ending mid-epoch (pretrain: 5 of 8 batches), two switches that change the
    batch (5: 4 -> 8 rows, mix is one epoch of 3 batches of 8; 8: 8 -> 4) and an epoch
    boundary inside a stage (finetune: 2 epochs of 6 batches, boundary at 14)."""
    for workers in (0, 2):
        out = one_rank[workers][0]
        assert out['stages'] == [['pretrain', 0, 5, 8], ['mix', 5, 3, 3], ['finetune', 8, 12, 6]]
        assert [len(b) for b in out['straight']] == [GLOBAL_BATCH] * 5 + [2 * GLOBAL_BATCH] * 3 + \
            [GLOBAL_BATCH] * 12


def test_every_position_resumes_exactly_on_one_rank(one_rank):
    assert_every_position_resumes(one_rank[0])


def test_every_position_resumes_exactly_with_two_workers(one_rank):
    assert_every_position_resumes(one_rank[2])
    # workers read the batches of one order: the same batches as without workers
    assert one_rank[2][0]['straight'] == one_rank[0][0]['straight']


def test_every_position_resumes_exactly_on_two_ranks(tmp_path, data, one_rank):
    two = run_ranks(tmp_path, data, 2, [0])[0]
    assert_every_position_resumes(two)
    # the two ranks slice the one-rank run's global batches: rank r trains columns
    # [rB, (r+1)B) of each
    for k, (r0, r1) in enumerate(zip(two[0]['straight'], two[1]['straight'])):
        one = one_rank[0][0]['straight'][k]
        assert (r0, r1) == (one[:len(one) // 2], one[len(one) // 2:]), k


@pytest.mark.slow
def test_every_position_resumes_exactly_on_two_ranks_with_two_workers(tmp_path, data):
    assert_every_position_resumes(run_ranks(tmp_path, data, 2, [2])[2])
