"""Pass-complete repetition through the real loader: ``repeat: 2.5`` over 3 epochs on 2 ranks.

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
    seen = {n: np.zeros(r, np.int64) for n, r in ROWS.items()}
    for b in range(plan.duration.total_batches):
        for rank in range(W):
            assert len(per_rank[rank][b]) == B
            for tag, row in per_rank[rank][b]:
                seen[TAGS[tag]][row] += 1
        for name, counts in seen.items():  # after every global batch
            drawn, n = int(counts.sum()), ROWS[name]
            k = drawn // n
            assert ((counts == k) | (counts == k + 1)).all(), (b, name, np.bincount(counts))
            assert int((counts == k + 1).sum()) == drawn - k * n
    assert {n: int(c.sum()) for n, c in seen.items()} == plan.duration.rows_per_stream
    # wiki: 2.5 passes an epoch, 7.5 over the run (less the rows cut for whole batches)
    assert plan.duration.rows_per_stream['wiki'] > 5 * ROWS['wiki']
