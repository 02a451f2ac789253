"""Pass-complete repetition through the real loader: ``repeat: 2.5`` over 3 epochs on 2 ranks,
and a curriculum whose second stage reuses the first's stream, over the run.

Rows are identified by the tokens they carry (stream tag, row number: ``mix_helpers.identity``),
not by the loader's sample ids. After every global batch, each row of a stream has been
trained exactly ``k`` or ``k+1`` times where ``k`` is the stream's completed passes, and
exactly as many rows ``k+1`` times as the stream's draws past ``k`` passes -- never a row
twice within a pass, and two passes never mixed; the totals are the plan's.
"""

from __future__ import annotations

import numpy as np
import pytest

from foundrymix.loader.mixer import StreamMixer
from foundrymix.loader.run_loader import StagedDataLoader
from foundrymix.plan.config import LoaderConfig
from foundrymix.plan.stages import plan_run
from foundrymix.plan.topology import Topology
from mix_helpers import build_three, identity, loader_dict

ROWS = {'arxiv': 120, 'wiki': 80, 'dolly': 60}
TAGS = {0: 'arxiv', 1: 'wiki', 2: 'dolly'}


@pytest.mark.parametrize('workers', [0, 2])
def test_repeat_two_and_a_half_over_three_epochs_on_two_ranks(tmp_path, workers):
    dirs = build_three(str(tmp_path))
    config = loader_dict(dirs, {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5},
                                'dolly': {'repeat': 0.5}}, shuffle_seed=11, num_workers=workers)
    B, W, epochs = 3, 2, 3
    mixer = StreamMixer.from_dict(config)
    plan = mixer.plan(B, f'{epochs}ep', world_size=W)
    per_rank = []
    for rank in range(W):  # each rank's loader in turn (one process: they share the directories)
        loader = mixer.build_dataloader(B, epochs=epochs, world_size=W, rank=rank)
        per_rank.append([[identity(row) for row in b['input_ids'].numpy()] for b in loader])
        loader.release()
        del loader
    assert len(per_rank[0]) == len(per_rank[1]) == plan.duration.total_batches
    seen = check_pass_complete(per_rank, B)
    assert {n: int(c.sum()) for n, c in seen.items()} == plan.duration.rows_per_stream
    # wiki: 2.5 passes an epoch, 7.5 over the run (less the rows cut for whole batches)
    assert plan.duration.rows_per_stream['wiki'] > 5 * ROWS['wiki']


def check_pass_complete(per_rank, B):
    """After every global batch (the ranks' slices side by side), each row of a stream trained k
    or k+1 times, k its completed passes, and exactly as many k+1 times as draws past k passes."""
    seen = {n: np.zeros(r, np.int64) for n, r in ROWS.items()}
    for b in range(len(per_rank[0])):
        for rank in range(len(per_rank)):
            assert len(per_rank[rank][b]) == B
            for tag, row in per_rank[rank][b]:
                seen[TAGS[tag]][row] += 1
        for name, counts in seen.items():
            drawn, n = int(counts.sum()), ROWS[name]
            k = drawn // n
            assert ((counts == k) | (counts == k + 1)).all(), (b, name, np.bincount(counts))
            assert int((counts == k + 1).sum()) == drawn - k * n
    return seen


def test_a_curriculum_goes_on_with_a_reused_streams_passes(tmp_path):
    """Stage 2 reuses stage 1's wiki (and arxiv), each stage with its own shuffle seed, on 2
    ranks: stage 1 leaves wiki mid-pass (about 1.75 passes), stage 2 trains the rest of that pass
    before any row of it a third time; the rows per stream are the plan's."""
    dirs = build_three(str(tmp_path))
    config = LoaderConfig.from_dict({
        'streams': {n: {'local': d} for n, d in dirs.items()}, 'shuffle_seed': 5, 'num_workers': 2,
        'stages': [{'name': 'one', 'duration': '35ba', 'streams': {'wiki': {'repeat': 1.5},
                                                                   'arxiv': {'repeat': 0.5}}},
                   {'name': 'two', 'duration': '30ba', 'streams': {'dolly': {'repeat': 1},
                                                                   'wiki': {'repeat': 1}}}]})
    B, W = 3, 2
    run, _ = plan_run(config, B, None, Topology(ranks_per_node=W), rank_count_limit=0)
    per_rank = []
    for rank in range(W):
        loader = StagedDataLoader(run, rank=rank)
        per_rank.append([[identity(row) for row in b['input_ids'].numpy()] for b in loader])
        loader.release()
        del loader
    assert len(per_rank[0]) == run.total_batches == 65
    first = run.stages[0].plan.duration.rows_per_stream
    assert first['wiki'] % ROWS['wiki'] and first['arxiv'] % ROWS['arxiv']  # left mid-pass
    seen = check_pass_complete(per_rank, B)
    assert {n: int(c.sum()) for n, c in seen.items() if c.sum()} == run.rows_per_stream
