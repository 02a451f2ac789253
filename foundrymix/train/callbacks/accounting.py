"""``StreamAccounting``: samples, tokens and loss tokens consumed per stream, against the plan.

Counting only: the counters live in Composer checkpoints (``state_dict`` /
``load_state_dict``), so a resumed run continues them instead of starting over; the
files are written by :mod:`foundrymix.train.report` from :meth:`StreamAccounting.summary`.

Collectives (why they are few and on the trainer's device): each rank counts its own
batches on the CPU (the batch is still on the CPU at ``after_dataloader``; Composer moves
it per microbatch) and the ranks' counts are summed with one ``all_reduce`` only where a
sum is read: at ``log_interval``, at the end and when a checkpoint is saved
(``state_dict``, which Composer 0.32 calls on every rank while saving). The reduced
tensor is moved to ``state.device`` first: Composer starts a plain ``nccl`` process group
on GPUs, which takes CUDA tensors only (a CPU tensor fails at the first reduce).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from foundrymix.errors import UserError
from foundrymix.format.schema import IGNORE_INDEX
from foundrymix.train import report

#: the counters, in the order of :meth:`StreamAccounting.count`'s rows
COUNTERS = ('samples', 'tokens', 'loss_tokens')


def interval_hit(timestamp: Any, interval: Time) -> bool:
    if interval.unit == TimeUnit.BATCH:
        return int(timestamp.batch) % interval.value == 0
    if interval.unit == TimeUnit.EPOCH:
        return int(timestamp.batch_in_epoch) == 0
    raise UserError(f'log interval must be in batches or epochs, got {interval}')


def count(batch: Mapping[str, torch.Tensor], n_streams: int) -> torch.Tensor:
    """This rank's batch as a ``(3, n_streams)`` tensor: samples, real tokens, loss tokens.

    From the batch itself: ``stream_id`` per row, ``attention_mask`` (real tokens) and
    ``labels`` (``IGNORE_INDEX`` where there is no loss).
    """
    stream_id = batch['stream_id'].reshape(-1)
    real = batch['attention_mask'].sum(dim=1)
    loss = (batch['labels'] != IGNORE_INDEX).sum(dim=1)
    counts = torch.zeros(3, n_streams, dtype=torch.int64, device=stream_id.device)
    counts[0].index_add_(0, stream_id, torch.ones_like(stream_id))
    counts[1].index_add_(0, stream_id, real.to(torch.int64))
    counts[2].index_add_(0, stream_id, loss.to(torch.int64))
    return counts


class StreamAccounting(Callback):
    """Count samples, tokens and loss tokens consumed per stream; compare with the plan.

    Counts come from the batches (:func:`count`), summed over all ranks. Every
    ``log_interval`` it records a history point and logs, per stream, cumulative tokens
    and loss tokens, the realized share of samples and tokens, the planned share of
    samples, and the epoch. At the end rank 0 writes ``stream_accounting.json`` (and
    ``.png`` with ``plot``) into ``out_dir``.
    """

    def __init__(self, stream_names: Sequence[str], planned_share: Sequence[float],
                 out_dir: str, log_interval: str = '10ba', plot: bool = True,
                 stage_names: Optional[Sequence[str]] = None) -> None:
        self.stream_names = list(stream_names)
        #: a staged run's stages; batches then carry ``stage_id`` and are counted per stage too
        self.stage_names = list(stage_names) if stage_names else None
        self.stage_counts = np.zeros((len(self.stage_names or ()), len(COUNTERS), len(self.stream_names)),
                                     dtype=np.int64)
        self.planned_share = [float(s) for s in planned_share]
        self.out_dir = out_dir
        self.log_interval = Time.from_timestring(log_interval)
        self.plot = plot
        self.counts = np.zeros((len(COUNTERS), len(self.stream_names)), dtype=np.int64)
        self.history: list[dict[str, Any]] = []
        #: this rank's counts since the last reduce (``counts`` and ``stage_counts`` hold sums over ranks)
        self._pending = np.zeros_like(self.counts)
        self._pending_stages = np.zeros_like(self.stage_counts)
        self._device: Any = None  # the trainer's Composer ``Device`` (from fit_start); None: the CPU

    @property
    def samples(self) -> np.ndarray:
        return self.counts[0]

    @property
    def tokens(self) -> np.ndarray:
        return self.counts[1]

    @property
    def loss_tokens(self) -> np.ndarray:
        return self.counts[2]

    # -- events -------------------------------------------------------------------
    def fit_start(self, state: State, logger: Logger) -> None:
        self._device = state.device

    def after_dataloader(self, state: State, logger: Logger) -> None:
        counts = count(state.batch, len(self.stream_names)).cpu().numpy()
        self._pending += counts
        if self.stage_names is not None:  # a batch never straddles two stages
            self._pending_stages[int(state.batch['stage_id'].reshape(-1)[0])] += counts

    def reduce(self) -> None:
        """Add every rank's pending counts to the counters: one ``all_reduce`` on the trainer's device.

        A collective: every rank calls it at the same points (interval, end, checkpoint save).
        """
        pending = torch.from_numpy(np.concatenate([self._pending.reshape(-1), self._pending_stages.reshape(-1)]))
        if self._device is not None:
            pending = self._device.tensor_to_device(pending)
        dist.all_reduce(pending, reduce_operation='SUM')
        summed = pending.cpu().numpy()
        self.counts += summed[:self.counts.size].reshape(self.counts.shape)
        self.stage_counts += summed[self.counts.size:].reshape(self.stage_counts.shape)
        self._pending[:] = 0
        self._pending_stages[:] = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        if interval_hit(state.timestamp, self.log_interval):
            self.reduce()
            self.record(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.reduce()
        if not self.history or self.history[-1]['batch'] != int(state.timestamp.batch):
            self.record(state, logger)
        if dist.get_global_rank() == 0:
            self.write_summary(state)

    def record(self, state: State, logger: Logger) -> None:
        """Append a history point and log the per-stream metrics."""
        point = {'batch': int(state.timestamp.batch), 'epoch': int(state.timestamp.epoch)}
        point.update({name: self.counts[i].tolist() for i, name in enumerate(COUNTERS)})
        self.history.append(point)
        metrics: dict[str, Any] = {'streams/epoch': int(state.timestamp.epoch)}
        for name, s in self.streams().items():
            for key in ('tokens', 'loss_tokens', 'share', 'token_share', 'planned_share'):
                metrics[f'streams/{name}/{key}'] = s[key]
        logger.log_metrics(metrics)

    # -- output -------------------------------------------------------------------
    def streams(self) -> dict[str, dict[str, Any]]:
        """Per stream: the counters, realized shares of samples and tokens, planned share."""
        total_samples = max(int(self.samples.sum()), 1)
        total_tokens = max(int(self.tokens.sum()), 1)
        return {name: {'samples': int(self.samples[i]),
                       'tokens': int(self.tokens[i]),
                       'loss_tokens': int(self.loss_tokens[i]),
                       'share': float(self.samples[i]) / total_samples,
                       'token_share': float(self.tokens[i]) / total_tokens,
                       'planned_share': self.planned_share[i]}
                for i, name in enumerate(self.stream_names)}

    def summary(self, state: Optional[State] = None) -> dict[str, Any]:
        """The report's data (without ``history``); ``batch``/``epoch`` from ``state`` if given."""
        out: dict[str, Any] = {'streams': self.streams(),
                               'total': {name: int(self.counts[i].sum()) for i, name in enumerate(COUNTERS)}}
        if self.stage_names is not None:
            out['stages'] = {
                stage: {name: {c: int(self.stage_counts[k, i, j]) for i, c in enumerate(COUNTERS)}
                        for j, name in enumerate(self.stream_names) if self.stage_counts[k, 0, j]}
                for k, stage in enumerate(self.stage_names)}
        if state is not None:
            out['batch'] = int(state.timestamp.batch)
            out['epoch'] = int(state.timestamp.epoch)
        return out

    @property
    def summary_path(self) -> str:
        return report.summary_path(self.out_dir)

    @property
    def plot_path(self) -> str:
        return report.plot_path(self.out_dir)

    def write_summary(self, state: Optional[State] = None) -> None:
        report.write_report({**self.summary(state), 'history': self.history}, self.out_dir, plot=self.plot)

    # -- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters summed over ranks, up to the last batch (a collective: reduces first)."""
        self.reduce()
        return {'stream_names': self.stream_names, 'samples': self.samples.tolist(),
                'tokens': self.tokens.tolist(), 'loss_tokens': self.loss_tokens.tolist(),
                'history': self.history, 'stage_names': self.stage_names,
                'stage_counts': self.stage_counts.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's counters, by stream name.

        The run's streams may have grown since the checkpoint (a stage appended with a
        stream the run had not used): those come after the checkpoint's (run-wide stream
        ids are in order of first use) and start at zero. A stream the checkpoint counted
        is never dropped -- the stages that trained it are immutable, so it is still in the
        run's plan; if not, the resume check has already refused the config.
        """
        old = list(state['stream_names'])
        if self.stream_names[:len(old)] != old:  # streams are numbered in order of first use
            raise UserError(f'checkpoint counts streams {old}, this run has {self.stream_names}: '
                             f'resuming a different mixture')
        cols = list(range(len(old)))

        def widen(rows: Any) -> np.ndarray:
            rows = np.array(rows, dtype=np.int64).reshape(-1, len(old))
            out = np.zeros((rows.shape[0], len(self.stream_names)), dtype=np.int64)
            out[:, cols] = rows
            return out

        self.counts = widen([state[name] for name in COUNTERS])
        self._pending[:] = 0
        self._pending_stages[:] = 0
        self.history = []
        for point in state['history']:
            point = dict(point)
            for name in COUNTERS:
                point[name] = widen([point[name]])[0].tolist()
            self.history.append(point)
        if self.stage_names is not None and state.get('stage_names') is None:
            # a run without stages (the stage 'main') that now has stages: it was all 'main'
            self.stage_counts[:] = 0
            if 'main' in self.stage_names:
                self.stage_counts[self.stage_names.index('main')] = self.counts
        elif self.stage_names is not None:
            stages = list(state.get('stage_names') or [])
            counts = np.array(state.get('stage_counts') or [], dtype=np.int64).reshape(
                len(stages), len(COUNTERS), len(old))
            self.stage_counts[:] = 0
            for k, stage in enumerate(stages):  # stages appended since the checkpoint start at 0
                if stage in self.stage_names:
                    self.stage_counts[self.stage_names.index(stage)] = widen(counts[k])
