"""A damaged shard that one rank alone reads stops every rank at that batch, each naming it.

Two real processes with a gloo process group (``RANK``/``WORLD_SIZE`` as a launcher sets
them), each reading its rows of the same global batches in a DataLoader worker, with
:class:`~foundrymix.train.together.StopTogether` set as the trainer sets it. Real damage:
one token bit of a real shard flipped (a valid id: only the hash sees it). The shard and
the batch size are chosen so that the first global batch holding the shard's rows gives
them to rank 1 only; unshuffled, global batch ``b`` is rows ``[bG, (b+1)G)`` and rank ``r``
its ``r``-th slice -- the independent expectation of what each rank read before the stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from helpers import ROOT, free_port
from integrity_helpers import copy_stream, flip_bits, index_of, rank_one_only, shard_hash_error

CHILD = textwrap.dedent('''
    import json, os, sys
    import torch.distributed as dist
    from foundrymix.loader.run_loader import StagedDataLoader
    from foundrymix.train.data_adapter import ComposerLoader
    from foundrymix.train.together import StopTogether
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.stages import plan_run
    from foundrymix.plan.topology import Topology
    job = json.loads(open(sys.argv[1]).read())
    dist.init_process_group('gloo')
    fail = job.get('fail_build')  # [rank, n]: that rank's n-th stage storage build fails
    if fail and dist.get_rank() == fail[0]:
        import foundrymix.loader.run_loader as run_loader
        from foundrymix.errors import UserError
        built, real = [], run_loader.build_store
        def build_store(*args, **kwargs):
            built.append(1)
            if len(built) == fail[1]:
                raise UserError("injected: this stage's storage could not be built here")
            return real(*args, **kwargs)
        run_loader.build_store = build_store
    batch = job['global_batch'] // dist.get_world_size()
    run, _ = plan_run(LoaderConfig.from_dict(job['config']), batch, job.get('duration', '1ep'),
                      Topology(nodes=1, ranks_per_node=dist.get_world_size()))
    loader = ComposerLoader(StagedDataLoader(run), together=StopTogether())
    got, error = [], None
    try:
        for b in loader:
            got.append(b['sample_id'].tolist())
    except Exception as e:
        error = [type(e).__name__, str(e)]
    with open(job['out'].format(rank=dist.get_rank()), 'w') as f:
        json.dump({'got': got, 'error': error}, f)
    dist.destroy_process_group()
''')


def run_two_ranks(tmp_path, job: dict) -> list[dict]:
    """Each rank's batches (sample ids) and its error, from two fresh gloo processes."""
    path = tmp_path / 'job.json'
    path.write_text(json.dumps({**job, 'out': str(tmp_path / 'rank{rank}.json')}))
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')]),
               'FOUNDRYMIX_CACHE': str(tmp_path / 'cache'), 'RANK': str(rank), 'LOCAL_RANK': str(rank),
               'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': port}
        procs.append(subprocess.Popen([sys.executable, '-c', CHILD, str(path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f'rank {rank}:\n{err[-4000:]}'
    return [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in range(2)]


def test_a_damaged_shard_one_rank_reads_stops_both_ranks_naming_it(tmp_path, small_streams):
    arxiv = copy_stream(small_streams['arxiv'], tmp_path / 'arxiv')
    g, k, starts = rank_one_only(arxiv)
    flip_bits(arxiv, k, 0, token=10)
    shard = index_of(arxiv)['shards'][k]['raw_data']['basename']
    bad_batch = starts[k] // g

    out = run_two_ranks(tmp_path, {
        'config': {'streams': {'arxiv': {'local': str(arxiv)}}, 'shuffle': False, 'num_workers': 1},
        'global_batch': g})

    half = g // 2
    for rank in range(2):  # every batch before the damaged one, on both ranks; none after
        assert out[rank]['got'] == [list(range(b * g + rank * half, b * g + (rank + 1) * half))
                                    for b in range(bad_batch)]
    damaged = shard_hash_error(arxiv, shard)
    assert out[1]['error'] == ['CorruptLocalShardError', damaged]
    assert out[0]['error'] == ['OtherRankFailed', 'rank 1 could not read its rows of this batch, so '
                               f'every rank stops here: CorruptLocalShardError: {damaged}']


def test_a_stage_storage_that_fails_on_one_rank_at_the_switch_stops_both_ranks(tmp_path, small_streams):
    """A stage's storage is built at its first batch; when that fails on rank 1 only (injected
    in the child: its second build raises), both ranks stop there: the first stage's 3
    batches read on both, none of the second."""
    arxiv = str(small_streams['arxiv'])
    stages = [{'name': 'a', 'duration': '3ba', 'streams': {'arxiv': {}}},
              {'name': 'b', 'duration': '2ba', 'streams': {'arxiv': {}}}]
    out = run_two_ranks(tmp_path, {
        'config': {'streams': {'arxiv': {'local': arxiv}}, 'shuffle': False, 'num_workers': 0,
                   'stages': stages},
        'global_batch': 4, 'duration': None, 'fail_build': [1, 2]})
    for rank in range(2):
        assert out[rank]['got'] == [[4 * b + 2 * rank, 4 * b + 2 * rank + 1] for b in range(3)]
    injected = "injected: this stage's storage could not be built here"
    assert out[1]['error'] == ['UserError', injected]
    assert out[0]['error'] == ['OtherRankFailed', 'rank 1 could not read its rows of this batch, so '
                               f'every rank stops here: UserError: {injected}']
