"""``SampleLog``: which global sample ids (and streams) each batch held, and a digest of the
tokens they were, as JSONL."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from composer.core import Callback, State, Time
from composer.loggers import Logger
from composer.utils import dist
import xxhash

from foundrymix.format.schema import DECODED_KEYS
from foundrymix.train.callbacks.accounting import interval_hit


def row_digests(batch: Any) -> list[str]:
    """Each row's ``xxh3_64`` hex digest over what the model is given of it (the
    :data:`~foundrymix.format.schema.DECODED_KEYS` tensors as ``int64``, in that order): equal
    digests mean equal tokens, labels, masks and positions."""
    rows = torch.stack([batch[k].to(torch.int64) for k in DECODED_KEYS], dim=1).cpu().numpy()
    return [xxhash.xxh3_64_hexdigest(row) for row in rows]  # (n, keys, seq): each row contiguous


#: how :func:`batch_digest` orders the row digests, written beside it in every log line
#: (``tokens_order``; lines without it hash them in rank order)
TOKENS_ORDER = 'sorted'


def batch_digest(rows: list[str]) -> str:
    """A global batch's ``tokens`` digest: ``xxh3_64`` over its rows' digests, sorted (a batch is one
    step on a set of rows: the digest does not depend on how the ranks list them)."""
    return xxhash.xxh3_64_hexdigest(''.join(sorted(rows)).encode())


class SampleLog(Callback):
    """Append each global batch's ``{"batch", "epoch", "sample_ids", "stream_ids", "tokens": <batch_digest>,
    "tokens_order": "sorted"}`` to a JSONL file (rank 0; ids in rank order). So that the file is what the
    weights saw, a resume drops the lines at or after its batch at the first batch, and rank 0 writes every
    ``interval``, at the end and at each checkpoint save."""

    def __init__(self, path: str, interval: str = '10ba') -> None:
        self.path = path
        self.interval = Time.from_timestring(interval)
        self._trimmed = False
        #: this rank's batches not yet written: batch, epoch, sample ids, stream ids, stage ids, row digests
        self._batches: list[tuple[int, int, list[int], list[int], Any, list[str]]] = []

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
        stage = state.batch.get('stage_id')
        self._batches.append((int(state.timestamp.batch), int(state.timestamp.epoch),
                              state.batch['sample_id'].reshape(-1).tolist(),
                              state.batch['stream_id'].reshape(-1).tolist(),
                              stage.reshape(-1).tolist() if stage is not None else None,
                              row_digests(state.batch)))

    def batch_end(self, state: State, logger: Logger) -> None:
        if interval_hit(state.timestamp, self.interval):
            self.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def state_dict(self) -> dict[str, Any]:
        """Nothing to store; writes the buffered lines first, so the checkpoint's batches are all in the file."""
        self.flush()
        return {}

    def flush(self) -> None:
        """Gather every rank's buffered batches and append them (rank 0). A collective."""
        gathered = dist.all_gather_object(self._batches)
        self._batches = []
        if dist.get_global_rank() != 0:
            return
        lines = []
        for k, (batch, epoch, _, _, stages, _) in enumerate(gathered[0]):
            line = {'batch': batch, 'epoch': epoch,
                    'sample_ids': [i for rank in gathered for i in rank[k][2]],
                    'stream_ids': [s for rank in gathered for s in rank[k][3]]}
            if stages is not None:  # a staged run: the stage of every sample
                line['stage_ids'] = [s for rank in gathered for s in rank[k][4]]
            line['tokens'] = batch_digest([d for rank in gathered for d in rank[k][5]])
            line['tokens_order'] = TOKENS_ORDER
            lines.append(json.dumps(line) + '\n')
        if not lines:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, 'a', encoding='utf-8') as f:
            f.writelines(lines)
