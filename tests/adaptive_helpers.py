"""The adaptive loader of ``tests/loader/test_adaptive.py``, shared with ``test_build_loader``:
three synthetic streams mixed by ``ado`` every ``EVERY`` batches, and :class:`Feeder`, a
deterministic stand-in for the trainer's per-stream loss, so the policy's decisions (and so
the batches) are the same on every run.
"""

from __future__ import annotations

import numpy as np
from mix_helpers import loader_dict

BATCH = 8
EVERY = 3
BATCHES = 20          # 7 segments, the last one 2 batches
ROWS = (40, 80, 60)   # arxiv, wiki, dolly: arxiv is read over several passes


def config(dirs: dict[str, str], **adaptive) -> dict:
    a = {'method': 'ado', 'every': f'{EVERY}ba', 'min_share': 0.05, 'beta': 0.3, **adaptive}
    return loader_dict(dirs, {'arxiv': {'proportion': 0.4}, 'wiki': {'proportion': 0.4},
                              'dolly': {'proportion': 0.2}}, epoch_size=200, adaptive=a)


def build(cfg: dict):
    from foundrymix.loader.run_loader import StagedDataLoader
    from foundrymix.plan.config import LoaderConfig
    from foundrymix.plan.stages import plan_run
    run, _ = plan_run(LoaderConfig.from_dict(cfg), BATCH, f'{BATCHES}ba')
    return StagedDataLoader(run)


class Feeder:
    """Stands in for the trainer's callback: a per-stream 'loss' from the rows of each batch
    (falls for arxiv as it is trained, flat for the others), fed at every segment boundary."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.rows: list[np.ndarray] = []     # per batch since the last update: (2, streams)
        self.seen = np.zeros(3)

    def batch(self, b) -> None:
        sid = b['stream_id'].numpy()
        out = np.zeros((2, 3))
        for s, ids in zip(sid, b['input_ids'].numpy()):
            loss = 5.0 - 4.0 * min(self.seen[0] / 150, 1) if s == 0 else 3.0 + int(ids[1]) % 7 / 100
            out[0, s] += loss * 100
            out[1, s] += 100
            self.seen[s] += 1
        self.rows.append(out)
        position = self.loader.position
        c = position.adaptive[0]
        done = position.batch
        if done < BATCHES and done % c.spec.every == 0:
            total = np.sum(np.stack(self.rows), axis=0)
            self.rows = []
            c.update(total[0], total[1])

    def state(self) -> dict:
        return {'rows': [r.copy() for r in self.rows], 'seen': self.seen.copy()}

    def load(self, state: dict) -> None:
        self.rows = [r.copy() for r in state['rows']]
        self.seen = state['seen'].copy()
