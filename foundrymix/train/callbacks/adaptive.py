"""``AdaptiveMixing``: feeds each adaptive stage's controller the per-stream training loss.

Per microbatch (``after_loss``) this rank's loss is summed per stream from the model's
logits (cross-entropy per loss token, the HF loss before its mean; under ``no_grad``).
At each segment boundary (``batch_end``, before Composer's checkpoint event) the ranks'
per-batch sums are all-reduced and the controller decides the next segment, which the
loader reads when its first batch is due. So every rank decides from the same numbers.

Why per-batch rows, not one running sum: a resumed run must decide bitwise as the straight
run did. A running sum split at a checkpoint adds the same numbers in another order
(``(a + b) + (c + d)`` vs ``((a + b) + c) + d``), which differs in the last bit; the
batches' rows since the last update are kept (reduced, in the checkpoint) and summed in
one ``np.sum`` over the same array either way. ``every x n_streams x 2`` floats.

Until the per-stream loss of the schedules issue (issue 23) lands, the loss is computed
here from the logits (one more cross-entropy per microbatch, no extra forward).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundrymix.format.schema import IGNORE_INDEX


def stream_loss(logits: torch.Tensor, labels: torch.Tensor, stream_id: torch.Tensor,
                n_streams: int) -> np.ndarray:
    """``(2, n_streams)`` float64: summed cross-entropy and loss tokens per stream.

    HF causal-LM labels are unshifted: the logit at ``t`` predicts the label at ``t + 1``.
    """
    with torch.no_grad():
        target = labels[:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), target.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction='none').reshape(target.shape)
        per_row = ce.double().sum(dim=1).cpu()
        tokens = (target != IGNORE_INDEX).sum(dim=1).double().cpu()
        out = torch.zeros(2, n_streams, dtype=torch.float64)
        sid = stream_id.reshape(-1).cpu()
        out[0].index_add_(0, sid, per_row)
        out[1].index_add_(0, sid, tokens)
    return out.numpy()


class AdaptiveMixing(Callback):
    """Per-stream loss -> the loader's adaptive controllers, at every segment boundary; at
    the end rank 0 writes ``mixture.json`` (every decision, the policy's state) to ``out_dir``."""

    def __init__(self, loader: Any, out_dir: str) -> None:
        self.loader = loader
        self.position = loader.position
        self.out_dir = out_dir
        self.n_streams = len(loader.stream_names)
        self._batch = np.zeros((2, self.n_streams))
        self._pending: list[np.ndarray] = []    # this rank's rows since the last reduce
        self._reduced: list[np.ndarray] = []    # all ranks' rows since the last update
        self._device: Any = None

    @property
    def mixture_path(self) -> str:
        return os.path.join(self.out_dir, 'mixture.json')

    def fit_start(self, state: State, logger: Logger) -> None:
        self._device = state.device

    def after_loss(self, state: State, logger: Logger) -> None:
        stage = self.position.run.stage_at(int(state.timestamp.batch))
        if stage.index not in self.position.adaptive:
            return
        logits = getattr(state.outputs, 'logits', state.outputs)
        self._batch += stream_loss(logits, state.batch['labels'], state.batch['stream_id'],
                                   self.n_streams)

    def _reduce(self) -> None:
        if not self._pending:
            return
        rows = torch.from_numpy(np.stack(self._pending))
        if self._device is not None:
            rows = self._device.tensor_to_device(rows)
        dist.all_reduce(rows, reduce_operation='SUM')
        self._reduced += list(rows.cpu().numpy())
        self._pending = []

    def batch_end(self, state: State, logger: Logger) -> None:
        done = int(state.timestamp.batch)  # batches trained, the next one's index
        stage = self.position.run.stage_at(done - 1)
        controller = self.position.adaptive.get(stage.index)
        if controller is None:
            return
        self._pending.append(self._batch)
        self._batch = np.zeros((2, self.n_streams))
        if done >= stage.end_batch or (done - stage.start_batch) % controller.every:
            if done >= stage.end_batch:
                self._pending, self._reduced = [], []
            return
        self._reduce()
        total = np.sum(np.stack(self._reduced), axis=0)
        self._reduced = []
        cols = [self.loader.stream_names.index(n) for n in controller.names]
        decision = controller.update(total[0, cols], total[1, cols])
        logger.log_metrics({f'adaptive/{n}/weight': w for n, w in zip(controller.names, decision.weights)})

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0:
            self.write_report()

    def report(self) -> dict[str, Any]:
        return {'stages': {self.position.run.stages[i].name: c.report()
                           for i, c in self.position.adaptive.items()}}

    def write_report(self, path: Optional[str] = None) -> None:
        path = path or self.mixture_path
        os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
        tmp = path + '.tmp'
        with open(tmp, 'w', encoding='utf-8') as f:
            json.dump(self.report(), f, indent=1)
        os.replace(tmp, path)

    def state_dict(self) -> dict[str, Any]:
        """The all-reduced loss rows since the last update (a collective: reduces first)."""
        self._reduce()
        return {'reduced': [r.tolist() for r in self._reduced]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reduced = [np.array(r, np.float64) for r in state.get('reduced', [])]
        self._pending = []
