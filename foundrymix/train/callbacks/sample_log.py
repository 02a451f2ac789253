"""``SampleLog``: which global sample ids (and streams) each batch held, as JSONL."""

from __future__ import annotations

import json
import os

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


class SampleLog(Callback):
    """Append each global batch's sample ids and streams to a JSONL file (rank 0).

    One line per batch: ``{"batch": b, "epoch": e, "sample_ids": [...], "stream_ids":
    [...]}`` in rank order. On resume, lines for batches at or after the checkpoint are
    dropped first, so the file always describes exactly what the weights saw.

    Why that happens at the first batch and not at ``fit_start``: a start that is refused
    after ``fit_start`` (Composer refusing to overwrite a finished run's checkpoints, a
    failing first batch) must leave an earlier run's log as it was; a rerun of a finished
    run's command truncated its 10-line log to 0 before.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._trimmed = False

    def _trim(self, state: State) -> None:
        """Drop lines for batches at or after this run's first batch (rank 0, once)."""
        self._trimmed = True
        if not os.path.exists(self.path):
            return
        resumed_at = int(state.timestamp.batch)
        with open(self.path, encoding='utf-8') as f:
            keep = [line for line in f if line.strip() and json.loads(line)['batch'] < resumed_at]
        with open(self.path, 'w', encoding='utf-8') as f:
            f.writelines(keep)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if not self._trimmed and dist.get_global_rank() == 0:
            self._trim(state)
        ids = state.batch['sample_id'].reshape(-1).tolist()
        streams = state.batch['stream_id'].reshape(-1).tolist()
        stage = state.batch.get('stage_id')
        stages = stage.reshape(-1).tolist() if stage is not None else None
        gathered = dist.all_gather_object((ids, streams, stages))
        if dist.get_global_rank() != 0:
            return
        line = {'batch': int(state.timestamp.batch), 'epoch': int(state.timestamp.epoch),
                'sample_ids': [i for rank_ids, _, _ in gathered for i in rank_ids],
                'stream_ids': [s for _, rank_streams, _ in gathered for s in rank_streams]}
        if stages is not None:  # a staged run: the stage of every sample
            line['stage_ids'] = [s for _, _, rank_stages in gathered for s in rank_stages]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, 'a', encoding='utf-8') as f:
            f.write(json.dumps(line) + '\n')
