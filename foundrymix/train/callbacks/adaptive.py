"""``AdaptiveMixing``: feeds each adaptive stage's controller the per-stream training loss.

Each microbatch's ``row_loss`` stays on the device with its stream ids; at each segment boundary
(``batch_end``, before the checkpoint event) it is summed per batch and stream on the CPU, in
order, and all-reduced, so every rank decides alike and a resumed run bitwise as the straight one
(a running sum split at a checkpoint, or GPU atomics, add in another order; docs/adaptive.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundrymix.errors import UserError


class AdaptiveMixing(Callback):
    """Per-stream loss -> the loader's adaptive controllers, at every segment boundary; at
    the end rank 0 writes ``mixture.json`` (every decision, the policy's state) to ``out_dir``."""

    def __init__(self, loader: Any, out_dir: str, accounting: Any) -> None:
        self.loader = loader
        self.accounting = accounting  # its planned share becomes the decided one at the end
        self.position = loader.position
        self.out_dir = out_dir
        self.n_streams = len(loader.stream_names)
        self._batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # this batch's rows
        self._pending: list[list[Any]] = []     # this rank's batches' rows since the last reduce
        self._reduced: list[np.ndarray] = []    # all ranks' rows since the last update
        self._device: Any = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._device = state.device

    def before_train_batch(self, state: State, logger: Logger) -> None:
        """Start the batch's rows over: Composer reruns a batch from here after running out of memory."""
        self._batch = []

    def after_loss(self, state: State, logger: Logger) -> None:
        stage = self.position.run.stage_at(int(state.timestamp.batch))
        if stage.index not in self.position.adaptive:
            return
        rows = getattr(state.outputs, 'row_loss', None)
        if rows is None:
            raise UserError('adaptive mixing needs the per-row loss foundrymix\'s model leaves on '
                            'its outputs (outputs.row_loss); this model does not report it')
        self._batch.append((state.batch['stream_id'].reshape(-1), rows.loss_sum, rows.targets))

    def _sum_batch(self, rows: list[Any]) -> np.ndarray:
        """One batch of this rank as ``(2, n_streams)`` float64, its rows added in order."""
        out = np.zeros((2, self.n_streams))
        for sid, loss_sum, targets in rows:
            sid = sid.cpu().numpy()
            np.add.at(out[0], sid, loss_sum.detach().double().cpu().numpy())
            np.add.at(out[1], sid, targets.double().cpu().numpy())
        return out

    def _reduce(self) -> None:
        if not self._pending:
            return
        rows = torch.from_numpy(np.stack([self._sum_batch(b) for b in self._pending]))
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
        self._pending.append(self._batch)  # stays on the device until the boundary
        self._batch = []
        if done >= stage.end_batch or (done - stage.start_batch) % controller.spec.every:
            if done >= stage.end_batch:
                self._pending, self._reduced = [], []
            return
        self._reduce()
        total = np.sum(np.stack(self._reduced), axis=0)
        self._reduced = []
        cols = [self.loader.stream_names.index(n) for n in controller.spec.names]
        decision = controller.update(total[0, cols], total[1, cols])
        logger.log_metrics({f'adaptive/{n}/weight': w for n, w in zip(controller.spec.names, decision.weights)})

    def fit_end(self, state: State, logger: Logger) -> None:
        self.accounting.planned_share = self.planned_share()  # before the accounting's fit_end writes it
        if dist.get_global_rank() == 0:
            self.write_report()

    def planned_share(self) -> list[float]:
        """Per run-wide stream, its share of the run's rows: a fixed stage's planned rows, an adaptive
        stage's decided ones (the rows the loader trains, where the accounting knew only the start)."""
        names = list(self.loader.stream_names)
        rows = np.zeros(len(names))
        for stage in self.position.run.stages:
            controller = self.position.adaptive.get(stage.index)
            if controller is not None:
                for d in controller.decisions:
                    for n, r in zip(controller.spec.names, d.rows):
                        rows[names.index(n)] += r
            elif stage.plan.duration and stage.plan.duration.rows_per_stream:
                for n, r in stage.plan.duration.rows_per_stream.items():
                    rows[names.index(n)] += r
        total = rows.sum()
        return [float(r / total) for r in rows] if total else list(self.accounting.planned_share)

    def report(self) -> dict[str, Any]:
        return {'stages': {self.position.run.stages[i].name: c.report()
                           for i, c in self.position.adaptive.items()}}

    def write_report(self) -> None:
        path = os.path.join(self.out_dir, 'mixture.json')
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
